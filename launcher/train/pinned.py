"""Host (or device) buffers that many tensors share: a rollback snapshot's copies of a rank's weights and
optimizer state (launcher/train/spike.py). Pinned host memory comes from CUDA's caching host allocator,
which rounds every allocation up to a power of two: one buffer per tensor would pin up to twice the bytes,
one buffer per dtype too; a few shared segments pin about what the tensors hold."""

from __future__ import annotations

import torch

SEGMENT_BYTES = 1 << 26  # 64 MiB: the buffers that a snapshot's tensors share (`packed`)


def packed(nbytes: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Tensors of `nbytes` bytes (one dtype), largest first, each into the first segment with room (64-byte
    aligned), a segment a power of two (SEGMENT_BYTES or a larger tensor's): (bytes of each segment, (segment,
    offset) of each tensor). CUDA's caching host allocator pins powers of two: a buffer per tensor cost up to 2x
    (8b's shards at dp_shard=8: 12.4 GiB for 11.2), one per dtype too (1b: 16 GiB for 13.8); segments ~1x."""
    segments: list[list[int]] = []  # [bytes used, room]
    at = [(0, 0)] * len(nbytes)
    for i in sorted(range(len(nbytes)), key=lambda i: -nbytes[i]):
        size = -(-nbytes[i] // 64) * 64
        seg = next((k for k, (used, room) in enumerate(segments) if used + size <= room), len(segments))
        if seg == len(segments):
            segments.append([0, max(SEGMENT_BYTES, 1 << (size - 1).bit_length())])
        at[i], segments[seg][0] = (seg, segments[seg][0]), segments[seg][0] + size
    return [used for used, _ in segments], at


def shared_buffers(live: list[torch.Tensor], where: torch.device, pin: bool) -> list[torch.Tensor]:
    """A view shaped like each of `live` into buffers on `where` that the tensors of a dtype share (`packed`)."""
    views = list(live)
    for dtype in dict.fromkeys(t.dtype for t in live):
        index = [i for i, t in enumerate(live) if t.dtype == dtype]
        used, at = packed([live[i].nbytes for i in index])
        flat = [torch.empty(n // dtype.itemsize, dtype=dtype, device=where, pin_memory=pin) for n in used]
        for i, (seg, offset) in zip(index, at, strict=True):
            views[i] = flat[seg][offset // dtype.itemsize :][: live[i].numel()].view(live[i].shape)
    return views
