"""The compat room: every private API of a dependency the project uses, one module per library side, so a
new version breaks in one place: PyTorch's (`torch_compat.py`), the compiler's counters (`compile_compat.py`),
distributed checkpoint's reading side (`dcp_compat.py`), pipelining's (`pipeline_compat.py`), fake tensors
and the memory tracker (`fake_compat.py`, the simulation's), Hydra's and submitit's (`hydra_compat.py`).
tests/unit/test_compat.py pins each against the installed versions.

May import: errors. Nothing else of the launcher.
"""
