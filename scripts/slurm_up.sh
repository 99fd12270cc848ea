#!/usr/bin/env bash
# Start a throw-away single-node SLURM cluster (munge, slurmdbd + MariaDB accounting, slurmctld, slurmd)
# with every file under one folder, and print the line that points clients at it:
#
#     eval "$(scripts/slurm_up.sh)"       # export SLURM_CONF=/tmp/launcher-slurm/etc/slurm.conf
#     scripts/slurm_down.sh               # stops it (pid files), SLURM_LOCAL_DIR=... to pick the folder
#
# Installs the Debian packages when they are missing (needs root and apt). Idempotent: a running
# cluster is left as it is. SLURM_LOCAL_DIR (default /tmp/launcher-slurm) picks the folder,
# SLURM_ACCOUNTING=0 skips slurmdbd/MariaDB. Progress goes to stderr; stdout carries only the export.
# Exit codes: 0 up; 3 the packages are missing and cannot be installed; 1 anything else.
set -euo pipefail

DIR=${SLURM_LOCAL_DIR:-/tmp/launcher-slurm}
ACCOUNTING=${SLURM_ACCOUNTING:-1}
CLUSTER=launcher
PARTITION=debug
CONF=$DIR/etc/slurm.conf
export SLURM_CONF=$CONF
PATH=$PATH:/usr/sbin:/sbin

say() { echo "slurm_up: $*" >&2; }
die() { say "$1"; [ -d "$DIR/log" ] && tail -n 5 "$DIR"/log/*.log >&2 2>/dev/null; exit "${2:-1}"; }
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null && ! grep -q '^State:.*Z' "/proc/$(cat "$1")/status" 2>/dev/null; }
wait_for() {  # wait_for SECONDS WHAT COMMAND...
    local limit=$1 what=$2
    shift 2
    for _ in $(seq $((limit * 10))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
    die "$what did not come up within ${limit}s (logs under $DIR/log)"
}

# --- packages -------------------------------------------------------------------------------------
need=(slurmctld slurmd sbatch munged)
packages=(slurmctld slurmd slurm-client munge)
if [ "$ACCOUNTING" = 1 ]; then
    need+=(slurmdbd mariadbd)
    packages+=(slurmdbd mariadb-server)
fi
missing=()
for cmd in "${need[@]}"; do command -v "$cmd" >/dev/null || missing+=("$cmd"); done
if [ ${#missing[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] || die "missing ${missing[*]} and not root: cannot apt-get install ${packages[*]}" 3
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install ${packages[*]}" 3
    say "installing ${packages[*]} (apt-get)"
    made_policy=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then  # keep the post-install scripts from starting services
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && made_policy=1
    fi
    ok=1
    apt-get update -q >&2 || ok=0
    [ $ok = 1 ] && { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        "${packages[@]}" >&2 || ok=0; }
    [ $made_policy = 1 ] && rm -f /usr/sbin/policy-rc.d
    [ $ok = 1 ] || die "apt-get could not install ${packages[*]}" 3
fi

# --- already up? ----------------------------------------------------------------------------------
running() {
    alive "$DIR/run/munged.pid" && alive "$DIR/run/slurmctld.pid" && alive "$DIR/run/slurmd.pid" &&
        { [ "$ACCOUNTING" != 1 ] || alive "$DIR/run/slurmdbd.pid"; } &&
        sinfo -h -N -o %T 2>/dev/null | grep -Eq '^(idle|mixed|allocated)'
}
if [ -f "$CONF" ] && running; then
    say "already running under $DIR"
    echo "export SLURM_CONF=$CONF"
    exit 0
fi
"$(dirname "$0")/slurm_down.sh" >/dev/null 2>&1 || true  # a half-started cluster: clean slate for the daemons

mkdir -p "$DIR"/{etc,run,log,state,spool/slurmd,mysql}
mkdir -p "$DIR/munge" && chmod 755 "$DIR" "$DIR/munge"  # munged refuses a socket folder that is not 755
NODE=$(hostname -s)

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
if [ ! -f "$DIR/etc/ports" ]; then
    echo "CTLD=$(free_port) SLURMD=$(free_port) DBD=$(free_port) DB=$(free_port)" >"$DIR/etc/ports"
fi
# shellcheck disable=SC1091
. "$DIR/etc/ports"

# --- munge ----------------------------------------------------------------------------------------
[ -f "$DIR/munge/munge.key" ] || mungekey -c -k "$DIR/munge/munge.key" >&2
chmod 600 "$DIR/munge/munge.key"
SOCKET=$DIR/munge/munge.socket
munged --socket="$SOCKET" --key-file="$DIR/munge/munge.key" --pid-file="$DIR/run/munged.pid" \
    --seed-file="$DIR/munge/munge.seed" --log-file="$DIR/log/munged.log" --force >&2 ||
    die "munged did not start"
wait_for 10 munged test -S "$SOCKET"

# --- slurm.conf -----------------------------------------------------------------------------------
node_line=$(slurmd -C | head -n 1 | sed -E "s/^NodeName=\S+/NodeName=$NODE NodeAddr=127.0.0.1/")
cpus=$(echo "$node_line" | sed -nE 's/.*CPUs=([0-9]+).*/\1/p')
mem=$(echo "$node_line" | sed -nE 's/.*RealMemory=([0-9]+).*/\1/p')
cat >"$CONF" <<EOF
ClusterName=$CLUSTER
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD
SlurmdPort=$SLURMD
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCKET
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/slurmd
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$((mem / cpus / 2))
SchedulerType=sched/backfill
ReturnToService=2
MailProg=/bin/true
JobRequeue=1
KillWait=5
MinJobAge=60
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
$node_line
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
if [ "$ACCOUNTING" = 1 ]; then
    cat >>"$CONF" <<EOF
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD
AccountingStoragePass=$SOCKET
JobAcctGatherType=jobacct_gather/none
EOF
fi

# --- accounting: MariaDB + slurmdbd ---------------------------------------------------------------
if [ "$ACCOUNTING" = 1 ]; then
    DBSOCK=$DIR/run/mysqld.sock
    if [ ! -d "$DIR/mysql/mysql" ]; then
        mariadb-install-db --no-defaults --datadir="$DIR/mysql" --user=root --auth-root-authentication-method=normal \
            --skip-test-db >"$DIR/log/mariadb-install.log" 2>&1 || die "mariadb-install-db failed"
    fi
    mariadbd --no-defaults --datadir="$DIR/mysql" --socket="$DBSOCK" --port="$DB" --bind-address=127.0.0.1 \
        --pid-file="$DIR/run/mysqld.pid" --log-error="$DIR/log/mariadb.log" --user=root --skip-name-resolve \
        --innodb-buffer-pool-size=32M >/dev/null 2>&1 &
    wait_for 30 MariaDB mariadb --no-defaults -S "$DBSOCK" -u root -e 'select 1'
    mariadb --no-defaults -S "$DBSOCK" -u root -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"
    cat >"$DIR/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$SOCKET
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$DIR/etc/slurmdbd.conf"
    slurmdbd >&2 || die "slurmdbd did not start"
    wait_for 30 slurmdbd sacctmgr -n list cluster
    sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER" || sacctmgr -i add cluster "$CLUSTER" >&2
fi

# --- slurmctld, slurmd ----------------------------------------------------------------------------
slurmctld -f "$CONF" -i >&2 || die "slurmctld did not start"
wait_for 30 slurmctld scontrol ping
slurmd -f "$CONF" -N "$NODE" >&2 || die "slurmd did not start"
wait_for 30 "node $NODE" sh -c "sinfo -h -N -o %T | grep -Eq '^(idle|mixed|allocated)'"
say "up under $DIR: partition $PARTITION, node $NODE ($cpus CPUs), accounting $([ "$ACCOUNTING" = 1 ] && echo on || echo off)"
echo "export SLURM_CONF=$CONF"
