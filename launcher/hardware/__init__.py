"""The hardware room: a profile (its schema: config/hardware.py) resolved into numbers (`resolve.py`), and
the measurements of this machine that fill a CPU profile (`calibration/`: matmul peak, links, host
overheads, cached per machine). The planner's view of a profile is planner/machine.py.

May import: config, layout, and (inside the probes, which run real blocks) model, parallel and train's
allocator. Never the planner or the launchers.
"""
