"""How a parallelism changes what the model computes without the model knowing: it swaps a module
of the model (the attention core, the positions, the fused projections) for its own, in place."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def swap_modules(model: nn.Module, kind: type[nn.Module], make: Callable[[nn.Module], nn.Module]) -> None:
    """Replace every submodule of `model` that is a `kind` by `make(it)`, under the same name (the
    swapped modules hold no parameters: names and checkpoints do not change)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, kind):
                setattr(parent, name, make(child))
