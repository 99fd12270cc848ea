"""Tests that run the launcher as a user does: the CLI, gloo workers, SLURM, sweeps, installs, checkpoints
across processes (most are marked `slow`; `make test-fast` leaves them out)."""
