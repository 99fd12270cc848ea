"""torch.distributed.pipelining's private side (the rest of torch's: compat/torch_compat.py): the compute order a
schedule runs on each rank, a stage without 2.11's sends to its own rank, and evaluation under the V
schedules. The first two are checked in tests/unit/test_compat.py, `forward_only` by the evaluations of
tests/unit/test_schedules.py against one process (both under `make test-compat` too).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from launcher.compat.torch_compat import fake_store

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.pipelining import PipelineStage


def schedule_actions(schedule: type, pp: int, stages: list[list[int]], microbatches: int) -> dict[int, list]:
    """The compute actions torch's `schedule` (a PipelineScheduleMulti class) runs on each pipeline
    rank, in order, as plain (kind, microbatch, stage) tuples: kind F, B, I or W; an overlapped
    forward-backward pair (DualPipeV) as its two parts. `pipeline_order` and `_Action` are private;
    the schedule is built (not run) for rank 0 of a fake process group, every rank's order being
    computed on each rank. `stages[r]`: the stages rank r holds."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=pp)
    try:
        n = sum(map(len, stages))
        parts = [PipelineStage(nn.Identity(), s, n, torch.device("cpu")) for s in stages[0]]
        built = schedule(parts, n_microbatches=microbatches, loss_fn=lambda out, target: out.sum())
        kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
        out: dict[int, list] = {}
        for rank, actions in built.pipeline_order.items():
            flat = [sub for a in actions if a is not None for sub in (a.sub_actions or (a,))]
            out[rank] = [(kinds[a.computation_type.name], a.microbatch_index, a.stage_index) for a in flat]
        return out
    finally:
        dist.destroy_process_group()


def pipeline_stage(module: nn.Module, index: int, n_stages: int, device: torch.device, group: Any) -> PipelineStage:
    """torch's `PipelineStage`, minus torch 2.11's sends to its own rank: 2.11's multi-stage schedules
    open each stage's links with a send and a receive to each neighbour stage
    (`_get_init_p2p_neighbors_ops`), also to one on the same rank (the V placement holds stages 1 and
    2 on rank 1), which gloo refuses ("Pair is not connected"). 2.15 has no such method."""
    return _pipeline_stage_class()(module, index, n_stages, device, group=group)


@functools.cache
def _pipeline_stage_class() -> type:
    from torch.distributed.pipelining import PipelineStage

    class Stage(PipelineStage):
        def _get_init_p2p_neighbors_ops(self) -> list:
            return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]

    return Stage


FORWARD_ACTIONS = {"FORWARD", "SEND_F", "RECV_F", "WAIT_SEND_F", "UNSHARD", "RESHARD"}  # by name: 2.15 adds waits


@contextlib.contextmanager
def forward_only(schedule: Any) -> Iterator[None]:
    """Around `schedule.eval` of a V schedule (zbv, dualpipev): its lowered order (computation and
    communication) with the forward's actions alone. torch evaluates through the training order, and
    where the V's two middle stages share a rank it hands a backward's gradient from one to the other,
    which fails with no backward ("can't steal_bwd_input if this stage doesn't have backward", 2.11 to
    2.15). Dropping actions keeps the forwards' order, so it cannot deadlock. `pipeline_order_with_comms`
    and `_Action` are private."""
    kept = schedule.pipeline_order_with_comms
    schedule.pipeline_order_with_comms = {
        rank: [
            sub
            for action in actions
            for sub in (action.sub_actions or (action,))
            if sub.computation_type.name in FORWARD_ACTIONS
        ]
        for rank, actions in kept.items()
    }
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = kept
