"""The hardware room: a profile (its schema: config/hardware.py) resolved into numbers (`resolve.py`), and
the measurements of this machine that fill a CPU profile (`probes/`: matmul peak, links, host
overheads, cached per machine), and the profile as the numbers the planner computes with: `profile.py`
(checks, calibration by need, link efficiency) gives a `Machine` (`machine.py`: devices, link levels).

May import: config, layout, and (inside the probes, which run real blocks) model, parallel and train's
allocator. Never the planner or the launchers.
"""
