#!/usr/bin/env bash
# Stop the throw-away SLURM cluster that scripts/slurm_up.sh started: cancel its jobs, then each daemon
# by its pid file (TERM, then KILL after 10 s). `--purge` also deletes the folder (SLURM_LOCAL_DIR,
# default /tmp/launcher-slurm). Safe to run when nothing is running.
set -uo pipefail

DIR=${SLURM_LOCAL_DIR:-/tmp/launcher-slurm}
export SLURM_CONF=$DIR/etc/slurm.conf
PATH=$PATH:/usr/sbin:/sbin

# A zombie left by a daemon's fork counts as stopped.
alive() { kill -0 "$1" 2>/dev/null && ! grep -q '^State:.*Z' "/proc/$1/status" 2>/dev/null; }

stop() {  # stop NAME: the daemon whose pid is in $DIR/run/NAME.pid
    local file=$DIR/run/$1.pid pid
    [ -s "$file" ] || return 0
    pid=$(cat "$file")
    if alive "$pid"; then
        kill -TERM "$pid" 2>/dev/null
        for _ in $(seq 100); do alive "$pid" || break; sleep 0.1; done
        alive "$pid" && kill -KILL "$pid" 2>/dev/null && echo "slurm_down: $1 ($pid) killed" >&2
    fi
    rm -f "$file"
}

if [ -f "$SLURM_CONF" ] && [ -s "$DIR/run/slurmctld.pid" ] && command -v squeue >/dev/null; then
    jobs=$(timeout 5 squeue -h -o %A 2>/dev/null | tr '\n' ' ')
    [ -n "${jobs// /}" ] && timeout 5 scancel $jobs 2>/dev/null && sleep 1
fi
for daemon in slurmd slurmctld slurmdbd mysqld munged; do stop "$daemon"; done
if [ "${1:-}" = --purge ]; then
    rm -rf "$DIR"
fi
echo "slurm_down: stopped (folder $DIR$([ "${1:-}" = --purge ] && echo ' removed'))" >&2
