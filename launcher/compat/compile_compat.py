"""torch.compile's private side (the rest of torch's private APIs: compat/torch_compat.py): the counters in which
dynamo records what it compiled and where it broke a graph. No public API reports either; the
checks of their shape are in tests/unit/test_compat.py."""

from __future__ import annotations


def compile_counts() -> tuple[int, dict[str, int]]:
    """The graphs dynamo has compiled in this process so far, and its graph breaks by reason."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), {str(k): int(v) for k, v in counters["graph_break"].items()}


def reset_compile_counts() -> None:
    """Forget what earlier compilations in this process counted (and their cached graphs)."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
