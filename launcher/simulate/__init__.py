"""`simulate=true`: one real training step of one rank of each pipeline position, on fake tensors.

In this one process, for the dp 0 / tp 0 rank of each pipeline position: the fake process group at the
layout's world size, the layout's DeviceMesh, the worker's own `build_runner` (every cut of
`parallelize`) with its parameters allocated as fake tensors (shapes, dtypes, no storage), the worker's
optimizer, and two training steps (the second with the optimizer state allocated), under torch's
memory tracker. Each rank's peak per category is printed beside the planner's prediction for the same
pipeline rank (`planner.memory.rank_memory`), and written as JSON.

- the fake-tensor machinery (torch's private `FakeTensorMode`, `MemTracker`) is launcher/compat/fake_compat.py.
- `step.py`: one rank built and stepped; a pipeline stage in its schedule's order (`pipeline.py`).
- `report.py`: the planner's figures beside the simulated ones, the table and the JSON.

May import every room up to the planner (it runs the runtime and asks the planner); `launch/` calls it.
"""

from launcher.simulate.report import check, simulate

__all__ = ["check", "simulate"]
