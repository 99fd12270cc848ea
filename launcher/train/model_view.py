"""The names a rank's state is saved and loaded under: the full model's, whatever the pipeline split
(launcher/train/checkpoint.py), so a checkpoint of one layout loads under another."""

from __future__ import annotations

from torch import nn

from launcher.parallel.tied import tied_copies


def model_view(parts: list[nn.Module]) -> nn.Module:
    """One module over a rank's pipeline stages with the full model's parameter names, so state
    dicts (and optimizer state) look the same whatever the pipeline split.

    Tied embeddings: the last stage's copy (launcher/parallel/tied.py) is also the view's
    `tok_embeddings.weight`, registered first, as the one-process model's shared parameter is: its
    optimizer state goes under that name, as there, and the first and last stages write the same
    (bit-equal) values to it, which DCP stores once."""
    copy = _output_copy(parts)
    if len(parts) == 1 and copy is None:
        return parts[0]
    view, layers = nn.Module(), nn.ModuleDict()
    if copy is not None:
        view.tok_embeddings = nn.Module()
        view.tok_embeddings.register_parameter("weight", copy)
    for part in parts:
        for name, child in part.named_children():
            if name == "layers":
                layers.update(child)
            else:
                setattr(view, name, child)
    view.layers = layers
    return view


def _output_copy(parts: list[nn.Module]) -> nn.Parameter | None:
    """The last stage's copy of a tied embedding when this rank holds no embedding of its own."""
    copies = tied_copies(parts)
    return copies[0] if len(copies) == 1 and all(part.tok_embeddings is None for part in parts) else None
