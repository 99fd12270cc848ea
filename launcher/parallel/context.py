"""Context parallelism: each sequence split over the cp ranks, attention by all-gathering K and V.

Load balancing. A sequence of S tokens is cut into 2 cp equal chunks; cp rank i holds chunks i and
2 cp - 1 - i (launcher/data/context_split.py, the rule the loader splits by), so every rank does the
same causal attention work.

Attention (the scheme Llama 3 trained its long-context stage with, Dubey et al. 2024, sec. 3.3.2):
each rank projects Q, K, V for its own tokens, all-gathers K and V over the cp group (one collective
per layer; its backward reduce-scatters dK and dV back to their owners), puts the keys back in
sequence order, and attends each local chunk's queries only to the keys up to that chunk's end, with a
causal mask aligned to its lower right (`attend`): the attention work is the causal half of cp=1's,
even over the cp ranks. On CUDA that mask is torch's `causal_lower_right` bias, which SDPA runs in
the flash kernel with K and V's GQA heads as they are: with an explicit mask SDPA would fall back to
the math kernel and its score matrices (`ContextShard.mask`). torch's experimental ring attention
has no CPU path (docs/parallelism.md); this one runs wherever SDPA does. RoPE and learned positions
use the global positions (`ContextPositions`, in place of the model's `Positions`).

Everything else is local per token: norms, the MLP, the loss (each rank's mean over its tokens; the
runner averages over cp ranks, all of which hold the same number of tokens). cp ranks hold identical
weights; their gradients are reduced with the data-parallel ones: FSDP shards over dp_shard x cp
(launcher/parallel/data.py), so the cp ranks' partial gradients are summed and divided like dp ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import causal_lower_right

from launcher.compat.torch_compat import all_gather_single, reduce_scatter_single
from launcher.data.context_split import local_positions, rank_chunks
from launcher.model.attention import CausalAttention, Positions
from launcher.parallel.swap import swap_modules


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over `group` (rank order); backward: reduce-scatter (sum) of the gradient,
    so each rank receives what every rank's queries contributed to its own keys and values."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        size = dist.get_world_size(group)
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        if not x.is_meta:  # the pipeline's shape inference runs stages on meta tensors
            all_gather_single(out, x.contiguous(), group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        size = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        reduce_scatter_single(out, grad.contiguous(), ctx.group)
        return out, None


class ContextShard:
    """One rank's share of every sequence, and the attention over the cp group that goes with it."""

    def __init__(self, group: dist.ProcessGroup, seq_len: int, device_type: str = "cpu") -> None:
        self.group, self.seq_len, self.device_type = group, seq_len, device_type
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._cache: dict[tuple, torch.Tensor] = {}

    def positions(self, device: torch.device) -> torch.Tensor:
        """Global positions of the local tokens (`ContextPositions`: for RoPE and learned positions)."""
        key = ("positions", device)
        if key not in self._cache:
            self._cache[key] = local_positions(self.seq_len, self.cp, self.rank).to(device)
        return self._cache[key]

    @property
    def chunk_len(self) -> int:
        """Tokens per chunk: the sequence is cut in 2 cp chunks."""
        return self.seq_len // (2 * self.cp)

    @property
    def chunks(self) -> tuple[int, int]:
        """The global chunks (of 2 cp) this rank holds, in local order."""
        return rank_chunks(self.cp, self.rank)

    def key_order(self, device: torch.device) -> torch.Tensor:
        """Where each global position sits among the gathered keys (rank order: chunks 0, 2 cp - 1, 1, ...)."""
        key = ("order", device)
        if key not in self._cache:
            gathered = torch.cat([local_positions(self.seq_len, self.cp, r) for r in range(self.cp)])
            self._cache[key] = gathered.argsort().to(device)
        return self._cache[key]

    def mask(self, chunk: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Causal mask of global chunk `chunk`'s queries against keys 0 .. its end, aligned to the lower
        right. Off CPU torch's `causal_lower_right` bias, no tensor: SDPA runs it in the flash kernel
        (whose causal flag means lower right) with the GQA heads unexpanded. A tensor mask would leave
        the math kernel: flash takes no mask, the memory-efficient kernel GQA only in recent torch, and
        cuDNN comes after math by default. On CPU, whose flash kernel takes a mask with GQA, the
        additive mask (0 where the key is not after the query, -inf elsewhere, compute dtype), built
        once per run like the RoPE table: torch's bias would build one per call there, and SDPA would
        save each layer's for backward."""
        c = self.chunk_len
        if self.device_type != "cpu":
            return causal_lower_right(c, (chunk + 1) * c)
        key = ("mask", chunk, device, dtype)
        if key not in self._cache:
            visible = torch.ones(c, (chunk + 1) * c, dtype=torch.bool, device=device).tril(chunk * c)
            zero = torch.zeros((), dtype=dtype, device=device)
            self._cache[key] = torch.where(visible, zero, torch.tensor(float("-inf"), dtype=dtype, device=device))
        return self._cache[key]

    # under torch.compile (per block, CUDA) the gather and its autograd stay eager: a graph break around
    # the attention core rather than tracing process-group calls
    @torch.compiler.disable
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, gqa: bool) -> torch.Tensor:
        """Local queries (batch, heads, s/cp, hd) against the K and V before them: one all-gather of both."""
        if q.shape[-2] * self.cp != self.seq_len:
            raise ValueError(f"context parallel over seq_len={self.seq_len} got {q.shape[-2]} local tokens")
        kv = torch.stack([k, v]).movedim(3, 0)  # (s/cp, 2, batch, kv heads, hd): gather along the sequence
        kv_all = _GatherSequence.apply(kv, self.group)[self.key_order(q.device)]
        k_all, v_all = kv_all.movedim(0, 3).unbind(0)
        c = self.chunk_len
        outs = []
        for chunk, q_chunk in zip(self.chunks, q.split(c, dim=-2)):
            k_seen, v_seen = k_all[..., : (chunk + 1) * c, :], v_all[..., : (chunk + 1) * c, :]
            mask = None if chunk == 0 else self.mask(chunk, q.device, q.dtype)  # chunk 0: a square causal block
            outs.append(
                F.scaled_dot_product_attention(
                    q_chunk, k_seen, v_seen, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, enable_gqa=gqa
                )
            )
        return torch.cat(outs, dim=-2)


class ContextPositions(nn.Module):
    """The model's `Positions` on a cp rank: the rows of its tokens' global positions."""

    def __init__(self, shard: ContextShard) -> None:
        super().__init__()
        self.shard = shard

    def forward(self, table: torch.Tensor, dim: int) -> torch.Tensor:
        return table.index_select(dim, self.shard.positions(table.device))


class ContextAttention(nn.Module):
    """The model's `CausalAttention` on a cp rank: local queries against every rank's keys before them."""

    def __init__(self, shard: ContextShard, dropout: float) -> None:
        super().__init__()
        self.shard, self.dropout = shard, dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: None = None) -> torch.Tensor:
        """`mask`: the model's document mask, always None here (data.document_mask refuses cp > 1)."""
        return self.shard.attend(q, k, v, self.dropout if self.training else 0.0, q.shape[1] != k.shape[1])


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, seq_len: int) -> None:
    """Make `model` (a whole model or a pipeline stage) run on this rank's share of `seq_len`-token
    sequences: global positions for RoPE and learned positions, and every attention over the group."""
    shard = ContextShard(cp_mesh.get_group(), seq_len, cp_mesh.device_type)
    swap_modules(model, Positions, lambda _: ContextPositions(shard))
    swap_modules(model, CausalAttention, lambda core: ContextAttention(shard, core.dropout))
