"""The launch room: the commands people type and the processes they start. `cli.py` (train, plan,
export-weights, doctor, generate), the local workers (`spawn.py`), SLURM (`slurm.py`, `slurm_job.py`), replica
groups (`ft.py`), sweeps (`sweep.py`), the dry run (`dryrun.py`), `doctor.py`, one run per directory
(`run_lock.py`) and a quick exit (`quick_exit.py`).

May import every other room; nothing imports it but Hydra's plugins (hydra_plugins/).
"""
