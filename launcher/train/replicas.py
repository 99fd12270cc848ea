"""One replica group's side of `ft` (docs/fault-tolerance.md): torchft's Manager joins this group's rank
to the same rank of every other group that takes part in a step (the Lighthouse's quorum).

Each step: `begin` asks for the quorum (asynchronously, during forward and backward); `sync` averages
the gradients and the loss over the groups in it, in one collective; `commit` says whether every rank
of this group may step its optimizer (a group that failed a collective skips the update, and torchft
heals it from a peer at the next quorum). With `ft` off the loop gets `Alone`, which does nothing."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch

from launcher.run import Run


class Alone:
    """`ft` off: the one group there is."""

    def begin(self) -> None:
        pass

    def sync(self, parts: list[torch.nn.Module], loss: float) -> float:
        return loss

    def commit(self) -> bool:
        return True

    def columns(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


class Replicas(Alone):
    """This rank's Manager; its `state` callbacks give and take what a recovering peer needs."""

    def __init__(self, run: Run, rank: int, state: Any, load_state: Any) -> None:
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        timeout = timedelta(seconds=run.ft.quorum_timeout_s)
        world = run.layout.world_size
        store_addr, store_port, self.store = group_store(world)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=load_state,
            state_dict=state,
            min_replica_size=run.ft.min_replicas,
            timeout=timeout,
            quorum_timeout=timeout,
            rank=rank,
            world_size=world,
            store_addr=store_addr,
            store_port=store_port,
            replica_id=f"replica_{run.replica}",
            init_sync=False,  # every group starts from the same seeded weights (or the same checkpoint)
        )

    def begin(self) -> None:
        self.manager.start_quorum()

    def sync(self, parts: list[torch.nn.Module], loss: float) -> float:
        """Average every gradient and the loss over the groups in this step's quorum (torchft divides
        by their number); a group that is only recovering contributes nothing."""
        grads = [local(p.grad) for part in parts for p in part.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads] + [torch.tensor([loss], dtype=grads[0].dtype)])
        self.manager.allreduce(flat).wait()
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        return float(flat[-1])

    def commit(self) -> bool:
        return self.manager.should_commit()

    def columns(self) -> dict[str, int]:
        return {"replicas": self.manager.num_participants()}

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def local(grad: torch.Tensor) -> torch.Tensor:
    """The gradient this rank holds (its shard of a DTensor): the groups' layouts are the same, so the
    same rank of each holds the same shard."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


def group_store(world: int) -> tuple[str, int, Any]:
    """Where this group's ranks meet their Manager: the store of the group's launcher (MASTER_ADDR and
    MASTER_PORT), or, for a group of one rank in this process, a store of its own (kept alive here)."""
    if world > 1:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return "127.0.0.1", store.port, store


def replicas_of(run: Run, rank: int, w: Any) -> Alone:
    """The loop's view of the other groups: `Alone` with `ft` off."""
    if run.replica is None:
        return Alone()

    def state() -> dict[str, Any]:
        return {"parts": [p.state_dict() for p in w.runner.parts], "optim": w.optimizer.state_dict()}

    def load_state(sd: dict[str, Any]) -> None:
        for part, part_sd in zip(w.runner.parts, sd["parts"], strict=True):
            part.load_state_dict(part_sd)
        w.optimizer.load_state_dict(sd["optim"])

    return Replicas(run, rank, state, load_state)
