"""One replica group's side of `ft` (docs/fault-tolerance.md): torchft's Manager joins this group's rank
to the same rank of every other group that takes part in a step (the Lighthouse's quorum).

Each step: `begin` asks for the quorum (asynchronously, during forward and backward); `sync` averages
the gradients and the loss over the groups in it, in one collective; `commit` says whether every rank
of this group may step its optimizer. A group that failed a collective (a peer died) redoes the step
with the same batch; a group behind the others (restarted) gets a peer's state in that quorum (the
model, optimizer, schedule, loader, step and spike guard: `state`), contributes no gradient to that
step, and then steps with the others. With `ft` off there is no such hook."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import threading
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from launcher.config.ft import ATTEMPT_ENV, BUCKET_BYTES, BUCKETS_IN_FLIGHT, START_ENV
from launcher.config.run import Run
from launcher.train.faults import fault_plan
from launcher.train.hooks import Hook, Step

if TYPE_CHECKING:
    from launcher.train.guard import Guard
    from launcher.train.spike import SpikeGuard

ENDED = "ended"  # set in the meeting store by the first group to finish the run
NCCL_NONBLOCKING_ENV = "TORCH_NCCL_NONBLOCKING_TIMEOUT"  # torchft's NCCL group: its own, set when unset


class Replicas(Hook):
    """This rank's Manager, and what a recovering peer receives from it: `w` is the rank's
    launcher.train.setup.Worker (which builds this: not imported here, no circle). A hook of the step
    (launcher/train/hooks.py): `begin` before it, `sync` after backward, `commit` asked before the update."""

    def __init__(self, run: Run, rank: int, w: Any) -> None:
        from torchft.manager import Manager

        self.w, self.replicas, self.kill_step = w, run.ft.replicas, injected_kill_step(run.replica, rank)
        self.step, self.before, self.healed_to = w.start, w.train_loader.state_dict(), None
        quiet_torchft()
        self.guard: Guard | None = None  # `share`, before the first step
        self.spikes: SpikeGuard | None = None
        self.backward_done = threading.Event()  # this step's: `state` may read the model (set in `sync`)
        timeout = timedelta(seconds=run.ft.quorum_timeout_s)
        self.timeout_s = timeout.total_seconds()
        world = run.layout.world_size
        self.meeting = meeting_store(timeout) if rank == 0 else None  # where the groups meet (LAUNCHER_FT_START)
        if self.meeting is not None and injected_late_return(run.replica):
            self.meeting.wait([ENDED])
        ended = self.meeting is not None and self.meeting.check([ENDED])
        store_addr, store_port, self.store, self.ended = group_store(rank, world, ended)
        self.manager = Manager(
            pg=cross_group(w.device, timeout),
            load_state_dict=self.load_state,
            state_dict=self.state,
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
        # The Manager counts the steps this group committed: from the step it resumed at, so that a
        # group behind the others (restarted, or resumed from an older checkpoint) is the one healed.
        self.manager.load_state_dict({"step": w.start, "batches_committed": 0})
        if self.meeting is not None and not self.ended:
            wait_for_groups(self.meeting, run.replica or 0, run.ft.replicas, timeout)

    def state(self) -> dict[str, Any]:
        """Read by the quorum's thread between `begin` and `commit`, while nothing here changes it; the model
        once this step's backward is done: FSDP's `state_dict` swaps the sharded parameters back in, which
        would break a forward under way (the main thread sets the event before it waits for the quorum)."""
        if not self.backward_done.wait(self.timeout_s):
            raise TimeoutError(f"step {self.step}: no backward done within the quorum timeout for a peer's state")
        w = self.w
        return {
            "parts": [p.state_dict() for p in w.runner.parts],
            "optim": w.optimizer.state_dict(),
            "schedule": w.schedule.state_dict(),
            "loader": self.before,  # before this step's batch: `state` runs while the main thread draws it
            "step": self.step,
            "skipped_steps": self.guard.skipped if self.guard is not None else 0,
            "spike": self.spikes.peer_state() if self.spikes is not None else None,  # window; rollback: snapshot
        }

    def load_state(self, sd: dict[str, Any]) -> None:
        """A peer's state at the start of its step `sd["step"]`: applied in `commit`, on the main thread."""
        w = self.w
        for part, part_sd in zip(w.runner.parts, sd["parts"], strict=True):
            part.load_state_dict(part_sd)
        w.optimizer.load_state_dict(owned(sd["optim"]))
        w.schedule.load_state_dict(sd["schedule"])
        w.train_loader.load_state_dict(sd["loader"])
        if self.guard is not None:
            self.guard.skipped = sd["skipped_steps"]
        if self.spikes is not None and sd["spike"] is not None:
            self.spikes.load_peer_state(sd["spike"])  # copied into the guard's own buffers
        self.before, self.healed_to = sd["loader"], sd["step"]

    def share(self, guard: Guard, spikes: SpikeGuard) -> None:
        """The guards, built after this: a group healing from this one receives their state."""
        self.guard, self.spikes = guard, spikes

    def before_step(self, s: Step) -> None:
        self.begin(s.number)

    def after_backward(self, s: Step) -> None:
        s.loss = self.sync(self.w.runner.parts, s.loss)

    def allow_update(self, s: Step) -> bool:
        """Not committed: the step is redone (the loop goes on from the one before)."""
        committed, s.number = self.commit(s.number)
        if not committed:
            s.redo = s.number - 1
        return committed

    def after_step(self, s: Step) -> None:
        if s.counted:
            s.row |= self.columns()  # how many replica groups took part in this step

    def at_end(self, stopped: bool) -> None:
        if not stopped:  # a stopped group resumes: the run has not ended
            self.close()

    def begin(self, step: int) -> None:
        self.step, self.before = step, self.w.train_loader.state_dict()
        self.backward_done.clear()
        self.manager.start_quorum()

    def sync(self, parts: list[torch.nn.Module], loss: float) -> float:
        """Average every gradient and the loss over the groups in this step's quorum (torchft divides
        by their number); a group that is only recovering contributes nothing."""
        if self.step == self.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        self.backward_done.set()  # the parameters are sharded again: the quorum's thread may read them
        grads = [local(p.grad) for part in parts for p in part.parameters() if p.grad is not None]
        total = torch.tensor([loss], dtype=grads[0].dtype, device=grads[0].device)
        in_flight: collections.deque = collections.deque()
        for bucket in buckets([*grads, total], BUCKET_BYTES):
            alone = len(bucket) == 1 and bucket[0].is_contiguous()  # reduced in place, no copy
            flat = bucket[0].view(-1) if alone else torch.cat([g.reshape(-1) for g in bucket])
            in_flight.append((bucket, flat, self.manager.allreduce(flat)))
            if len(in_flight) == BUCKETS_IN_FLIGHT:
                unpack(*in_flight.popleft())
        while in_flight:
            unpack(*in_flight.popleft())
        return float(total)

    def commit(self, step: int) -> tuple[bool, int]:
        """Whether to step the optimizer, and the step this is: a group that healed just now is on its
        peer's step, its loader past the batch the peer drew. Not committed: the loader goes back before
        this step's batch, for the loop to redo the step."""
        committed = self.manager.should_commit()
        healed, self.healed_to = self.healed_to, None
        if not committed:
            self.w.train_loader.load_state_dict(self.before)
            return False, healed if healed is not None else step
        if healed is None:
            return True, step
        self.w.train_loader.next_batch()  # the peer's batch of this step: its gradient came with the peer's
        return True, healed

    def columns(self) -> dict[str, int]:
        return {"replicas": self.manager.num_participants()}

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """The steps some group missed (a tokens' count of its batches that no one trained on)."""
        short = [row for row in rows if row["replicas"] < self.replicas]
        per_group = self.w.run.layout.global_batch * self.w.run.options.seq_len
        missed = sum((self.replicas - row["replicas"]) * per_group for row in short)
        return {"ft_short_steps": [row["step"] for row in short], "ft_tokens_missed": missed}

    def close(self) -> None:
        """At the end of the run: a group (re)started from now on finds it ended, and trains nothing."""
        if self.meeting is not None:
            self.meeting.set(ENDED, "1")
        self.manager.shutdown(wait=False)


def cross_group(device: torch.device, timeout: timedelta) -> Any:
    """torchft's process group between the groups, on the gradients' device: NCCL on CUDA (no copy of
    the gradients through host memory), gloo on a CPU."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    if device.type != "cuda":
        return ProcessGroupGloo(timeout=timeout)
    os.environ.setdefault(NCCL_NONBLOCKING_ENV, str(timeout.total_seconds()))  # else torchft warns, then sets it
    return ProcessGroupNCCL(timeout=timeout)


def buckets(tensors: list[torch.Tensor], cap: int) -> list[list[torch.Tensor]]:
    """`tensors` in order, cut into runs of one dtype of at most `cap` bytes (a larger tensor alone)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not out or out[-1][0].dtype != t.dtype or size + nbytes > cap:
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return out


def unpack(bucket: list[torch.Tensor], flat: torch.Tensor, work: Any) -> None:
    """Once its all-reduce is done, the averaged values back into the bucket's tensors."""
    work.wait()
    if len(bucket) == 1 and flat.data_ptr() == bucket[0].data_ptr():
        return  # reduced in place
    offset = 0
    for t in bucket:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def quiet_torchft() -> None:
    """torchft's Manager warns at every new quorum that it cannot reset NCCL's flight recorder (none on
    gloo), and logs a whole traceback when a peer group dies, which `ft` expects and handles: the first
    is dropped, the second kept as its one line. Healing, torch warns that the received state's buffer is
    read-only: nothing writes to it (`owned`), so that warning is dropped too."""
    warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
    manager_log = logging.getLogger("torchft.manager")
    if one_line not in manager_log.filters:
        manager_log.addFilter(one_line)


def one_line(record: logging.LogRecord) -> bool:
    record.exc_info = record.exc_text = None
    return "flight recorder" not in record.getMessage()


def owned(state: Any) -> Any:
    """`state` with every tensor copied: torchft's transport hands over tensors on its read-only receive
    buffer, and an optimizer keeps the tensors it loads (and steps them in place). Model parameters and
    the spike guard copy on load, so they need no copy here."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {key: owned(value) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(owned(value) for value in state)
    return state


def local(grad: torch.Tensor) -> torch.Tensor:
    """The gradient this rank holds (its shard of a DTensor): the groups' layouts are the same, so the
    same rank of each holds the same shard."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


def group_store(rank: int, world: int, ended: bool) -> tuple[str, int, Any, bool]:
    """Where this group's ranks meet their Manager: a store of this attempt's own, served by rank 0 (kept
    alive here), and whether the run has ended (rank 0's `ended`, for every rank). The launcher's store
    outlives a restart: a restarted rank would read the dead Manager's address from it."""
    store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False) if rank == 0 else None
    shared = [store.port if store is not None else 0, ended]
    if world > 1:
        dist.broadcast_object_list(shared, src=0)
    return os.environ.get("MASTER_ADDR", "127.0.0.1"), shared[0], store, shared[1]


def meeting_store(timeout: timedelta) -> dist.TCPStore:
    """The store the groups share for the whole run (served by the launcher: launcher/launch/ft.py)."""
    host, port = os.environ[START_ENV].rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timeout)


def wait_for_groups(store: dist.TCPStore, replica: int, replicas: int, timeout: timedelta) -> None:
    """Before its first quorum, each group waits (up to the quorum timeout) until every group has its
    Manager: else the first groups to start would step without the slower ones (ft.min_replicas < replicas).
    A restarted group finds them all there."""
    store.set(f"started/{replica}", "1")
    with contextlib.suppress(dist.DistStoreError):
        store.wait([f"started/{g}" for g in range(replicas)], timeout)


def restarted() -> bool:
    """A group's later life: the elastic agent's restart count, or the SLURM script's attempt."""
    return any(os.environ.get(name, "0") != "0" for name in ("TORCHELASTIC_RESTART_COUNT", ATTEMPT_ENV))


def injected_kill_step(replica: int | None, rank: int) -> int | None:
    """The step at which this group's rank 0 dies, in its first life (tests only: LAUNCHER_TEST_KILL,
    launcher/train/faults.py)."""
    kill = fault_plan().kill_of(replica)
    return kill.step if kill and rank == 0 and not restarted() else None


def injected_late_return(replica: int | None) -> bool:
    """This group's later life waits until the run has ended (tests only: LAUNCHER_TEST_KILL `late`), so
    that a test of a group that finds the run over does not race the restart, whose time varies."""
    kill = fault_plan().kill_of(replica)
    return bool(kill and kill.late and restarted())


def replicas_of(run: Run, rank: int, w: Any) -> Replicas | None:
    """The step's hook for the other groups: None with `ft` off."""
    return None if run.replica is None else Replicas(run, rank, w)
