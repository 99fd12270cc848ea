"""The rollback snapshot's buffers (launcher/train/spike.py): views into buffers the tensors of a dtype share,
segments of a power of two (CUDA's caching host allocator pins every allocation rounded up to one, so a buffer
per tensor cost up to twice the bytes, and so would one buffer per dtype), reused from one snapshot to the next,
and a rollback that puts every tensor back bit for bit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from launcher.config.schema import compose_config
from launcher.data import BatchLoader
from launcher.model.init import meta_model
from launcher.train.pinned import packed
from launcher.train.spike import Detector, Snapshot, Trainee, model_tensors, optimizer_tensors
from tests.conftest import make_config


class Mixed(nn.Module):
    """Parameters of two dtypes and an integer buffer, some tensors empty or scalar: every case a view meets."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 3)
        self.b = nn.Linear(3, 7).to(torch.bfloat16)
        self.scale = nn.Parameter(torch.tensor(2.0))
        self.register_buffer("count", torch.arange(6).view(2, 3))
        self.register_buffer("none", torch.zeros(0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).to(torch.bfloat16)).float().sum() * self.scale


def trainee() -> Trainee:
    torch.manual_seed(0)
    model = Mixed()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
    loader = BatchLoader(np.arange(5000, dtype=np.uint16), 8, 4)
    return Trainee([model], optimizer, schedule, loader, torch.device("cpu"))


def step(t: Trainee) -> None:
    t.parts[0](torch.randn(4, 5)).backward()
    t.optimizer.step()
    t.optimizer.zero_grad()
    t.schedule.step()


def storages(saved: list[torch.Tensor]) -> dict[torch.dtype, set[int]]:
    found: dict[torch.dtype, set[int]] = {}
    for s in saved:
        found.setdefault(s.dtype, set()).add(s.untyped_storage().data_ptr())
    return found


def test_a_snapshot_is_one_buffer_per_dtype_reused_and_restored_bit_for_bit() -> None:
    t, detector = trainee(), Detector(make_config("guard.spike=rollback").guard)
    step(t)  # AdamW's state exists
    snap = Snapshot(torch.device("cpu"))
    snap.take(1, t, detector)
    for saved, live in ((snap.model, model_tensors(t.parts)), (snap.optim, optimizer_tensors(t.optimizer))):
        found = storages(saved)
        assert all(len(ptrs) == 1 for ptrs in found.values()), found  # one storage per dtype
        assert set(found) == {x.dtype for x in live}
        flat = {s.untyped_storage().data_ptr(): s.untyped_storage().nbytes() for s in saved}
        assert sum(flat.values()) == sum(-(-x.nbytes // 64) * 64 for x in live)  # each 64-byte aligned
    assert set(storages(snap.model)) == {torch.float32, torch.bfloat16, torch.int64}
    kept = [[x.clone() for x in tensors] for tensors in (model_tensors(t.parts), optimizer_tensors(t.optimizer))]
    for _ in range(3):
        step(t)
    assert snap.restore(t, detector) == 1
    restored = (model_tensors(t.parts), optimizer_tensors(t.optimizer))
    for before, after in zip(kept, restored, strict=True):
        assert len(before) == len(after)
        for x, y in zip(before, after, strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y)
    buffers = storages(snap.model), storages(snap.optim)
    step(t)
    snap.take(2, t, detector)  # the next snapshot reuses the buffers
    assert (storages(snap.model), storages(snap.optim)) == buffers
    assert all(torch.equal(x, y) for x, y in zip(snap.model, model_tensors(t.parts), strict=True))


def pinned(nbytes: int) -> int:
    """What CUDA's caching host allocator pins for `nbytes`: the next power of two."""
    return 1 << (nbytes - 1).bit_length() if nbytes else 0


def state_bytes(model: str, shard: int) -> list[int]:
    """The bytes of each tensor of a rank's snapshot (weights, AdamW's two moments and step; buffers) at
    dp_shard=`shard` (dim 0 split), from the meta model: nothing allocated."""
    m = meta_model(compose_config(f"+model={model}").model)
    out = []
    for p in m.parameters():
        n = math.prod((-(-p.shape[0] // shard), *p.shape[1:])) * 4
        out += [n, n, n, 4]
    return out + [b.nbytes for b in m.buffers()]


@pytest.mark.parametrize(
    ("model", "shard", "per_tensor", "one_buffer"), [("1b", 1, 13.88, 16.0), ("8b", 8, 12.38, 16.0)]
)
def test_packed_snapshots_pin_their_bytes_not_powers_of_two(
    model: str, shard: int, per_tensor: float, one_buffer: float
):
    """1b on one rank (13.8 GiB) and 8b's shards at dp_shard=8 (11.2 GiB): a buffer per tensor pinned 13.88 and
    12.38 GiB, one buffer per dtype would pin 16; the segments pin within 1% of the bytes."""
    nbytes = state_bytes(model, shard)
    raw = sum(nbytes)
    assert sum(pinned(n) for n in nbytes) / 2**30 == pytest.approx(per_tensor, abs=0.01)
    assert pinned(raw) / 2**30 == one_buffer
    used, at = packed(nbytes)
    assert sum(pinned(n) for n in used) < 1.01 * raw
    spans = sorted((seg, offset, offset + n) for (seg, offset), n in zip(at, nbytes, strict=True))
    assert all(offset % 64 == 0 for _, offset, _ in spans)
    assert all(a[0] != b[0] or a[2] <= b[1] for a, b in zip(spans, spans[1:]))  # no two overlap
    assert all(end <= used[seg] for seg, _, end in spans)
