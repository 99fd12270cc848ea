"""Does the layout fit? Measured peak memory per rank beside the planner's prediction, `steps=0`
(build every rank's shards for real, optionally one forward/backward, stop), and the one-line report
of a rank that runs out of memory while building."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from launcher.errors import OutOfMemory
from launcher.flops import GIB
from launcher.layout import Layout
from launcher.model.init import AllocationFailed
from launcher.parallel.runner import Runner
from launcher.train.preemption import collective_device

if TYPE_CHECKING:
    from launcher.config.prediction import Prediction


def gather_rows(values: list[float]) -> list[list[float]]:
    """`values` from every rank, one row per rank in rank order (outside a process group: this
    process's alone). One tensor all-gather and one read back, not a pickled object: it runs every step."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.float64, device=collective_device())
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return torch.stack(out).tolist()


def gather_ranks(value: float) -> list[float]:
    """`value` from every rank, in rank order."""
    return [row[0] for row in gather_rows([value])]


def memory_summary(per_rank: list[float], key: str = "peak_mem_gib") -> dict[str, Any]:
    """The worst rank's figure under `key`, every rank's under `key`_per_rank."""
    return {key: max(per_rank), f"{key}_per_rank": per_rank}


def predicted_gib(prediction: Prediction | None) -> float | None:
    return prediction.memory.as_gib()["total"] if prediction else None


BUILT = ("params", "buffers", "overhead")  # what `steps=0` holds: the optimizer's moments come with the first step
SMOKED = (*BUILT, "grads", "activations", "logits")  # `smoke`: one forward/backward's peak besides


def predicted_build_gib(prediction: Prediction | None, smoke: bool) -> float | None:
    """The planner's memory for what `steps=0` measures (never a training step's whole peak, which
    beside a build would read as a planner error)."""
    if prediction is None:
        return None
    parts = prediction.memory.as_gib()
    return round(sum(parts[k] for k in (SMOKED if smoke else BUILT)), 3)


def out_of_memory(rank: int, err: AllocationFailed, prediction: Prediction | None) -> OutOfMemory:
    predicted = predicted_gib(prediction)
    estimate = f"the planner estimated {predicted:.2f} GiB per rank" if predicted is not None else "no planner estimate"
    return OutOfMemory(
        f"rank {rank} ran out of memory building the model: it tried to allocate {err.nbytes / GIB:.3f} GiB "
        f"({err.nbytes} bytes) for {err.what}; {estimate}: use more tp/pp/dp_shard, or devices with more memory"
    )


def smoke_step(runner: Runner, layout: Layout, batch: tuple[torch.Tensor, torch.Tensor], device: Any) -> float:
    """One forward/backward on one microbatch (a pipeline schedule runs its fixed number of them:
    the rank's whole batch), gradients dropped: does a step fit, beside the weights?"""
    inputs, targets = batch
    if layout.pp == 1:
        inputs, targets = inputs[: layout.micro], targets[: layout.micro]
    loss = runner.forward_backward(inputs.to(device), targets.to(device))
    for part in runner.parts:
        part.zero_grad(set_to_none=True)
    return loss


def memory_lines(per_rank: list[float], predicted: float | None, what: str = "") -> list[str]:
    """One line per rank: measured peak beside the planner's prediction (its worst rank's memory)."""
    versus = f" · predicted {predicted:.3f} GiB{what}" if predicted is not None else ""
    return [f"rank {rank}: peak memory {gib:.3f} GiB measured{versus}" for rank, gib in enumerate(per_rank)]
