"""Mixture of experts: router, SwiGLU experts, shared experts, load balancing.

A MoE layer replaces a block's dense MLP (`model.moe.experts` > 0, after `first_dense_layers` dense
ones). Per token the router scores every routed expert (sigmoid as DeepSeek-V3, or softmax), picks
the top k and weighs their outputs by the picked scores normalized to sum 1; shared experts see
every token. Tokens are grouped by expert, run through each expert's SwiGLU (launcher/ops/experts.py:
a loop over experts, or one grouped GEMM per weight on CUDA), and summed back.

Balancing (`model.moe.balance`):
- `bias` (DeepSeek-V3's auxiliary-loss-free balancing): a per-expert bias is added to the scores for
  the top-k *selection only*; the gating weights use the raw scores. After each optimizer step the
  bias moves by gamma towards balance (`balance_step`), from token counts summed over the data-parallel
  ranks, so no extra loss term pulls against the language-modelling loss.
- `aux`: the classic load-balancing loss (Switch/GShard: E * sum_i f_i P_i) over the micro-batch.
- `seq_aux_loss_coef` > 0: DeepSeek-V3's sequence-wise version of the same loss, on top of any balance.
Auxiliary losses enter through the gradient only (`_AddAuxLoss`): the reported loss stays the LM loss.

`model.moe.force_balance` (a benchmark's knob, as Megatron's force load balancing; `simulate=true` sets it):
token t's pick j goes to expert (t*k + j) % E instead of the router's top k, gated by the router's scores at
those experts (the router still learns, the routing costs what it does). Every expert's rows are then known
on the host (`balanced_picks`): no op has an output shape read from a tensor, none reads one back, so the
layer runs on fake tensors, which have no values.

Expert parallelism (launcher/parallel/expert.py) sets `exchange`: the experts' weights are then this
rank's slice, and `route` exchanges tokens with an all-to-all before and after them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from itertools import accumulate
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from launcher.compat.torch_compat import in_backward
from launcher.config.model import ModelConfig
from launcher.flops import expert_width
from launcher.model.knobs import PLAIN, Knobs
from launcher.model.moe_table import EXTRA, layer_records, layer_rows
from launcher.ops.experts import Experts, local


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    return cfg.moe.experts > 0 and layer >= cfg.moe.first_dense_layers


def balance_loss(scores: torch.Tensor, idx: torch.Tensor, experts: int) -> torch.Tensor:
    """E * sum_i f_i P_i averaged over groups: scores (groups, tokens, E), idx (groups, tokens, k).
    f_i: share of the group's top-k picks that went to expert i; P_i: its mean normalized score."""
    groups, tokens, k = idx.shape
    picks = torch.zeros(groups, experts, device=scores.device).scatter_add_(
        1, idx.reshape(groups, -1), torch.ones(groups, tokens * k, device=scores.device)
    )
    f = picks / (tokens * k)
    p = (scores / scores.sum(-1, keepdim=True)).mean(1)
    return experts * (f * p).sum(-1).mean()


class _AddAuxLoss(torch.autograd.Function):
    """y unchanged forward; backward also sends d(scale * aux)/d(aux) = scale into the aux loss."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.like = scale, aux
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full_like(ctx.like, ctx.scale), None


class _Combine(torch.autograd.Function):
    """Each token's picks summed, weighted by their gates: `index_add_` of gate x output rows. As one
    node it saves the output rows (the gates' gradient reads them), not also the gated rows that
    `index_add_`'s autograd keeps for their shape alone: a routed copy per pick less."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, gate: torch.Tensor, token: torch.Tensor, shape: Any, dtype: Any) -> Any:
        ctx.save_for_backward(out, gate, token)
        return out.new_zeros(shape, dtype=dtype).index_add_(0, token, out * gate[:, None])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out, gate, token = ctx.saved_tensors
        picked = grad.index_select(0, token)
        return picked * gate[:, None], (picked * out).sum(-1), None, None, None


class MoE(nn.Module):
    def __init__(
        self, cfg: ModelConfig, shared_mlp: Callable[[ModelConfig], nn.Module], layer: int = 0, knobs: Knobs = PLAIN
    ) -> None:
        super().__init__()
        moe = cfg.moe
        self.layer = layer  # the block's index in the whole model (pipeline stages keep it): metrics per layer
        self.n_experts, self.top_k = moe.experts, moe.top_k
        self.score, self.balance, self.capacity_factor = moe.score, moe.balance, moe.capacity_factor
        self.aux_coef = moe.aux_loss_coef if moe.balance == "aux" else 0.0
        self.seq_aux_coef = moe.seq_aux_loss_coef
        self.bias_rate = moe.bias_update_rate
        self.aux_scale = knobs.aux_scale  # the auxiliary losses' scale per micro-batch (1 / microbatches)
        self.force_balance = moe.force_balance  # round-robin picks, counts known on the host (`balanced_picks`)
        # expert parallelism's (x, counts, host=counts on the host | None) -> outputs over the ep ranks, set by
        # launcher/parallel/expert.py
        self.exchange: Callable[..., torch.Tensor] | None = None
        self.router = nn.Parameter(torch.empty(moe.experts, cfg.dim))
        self.experts = Experts(moe.experts, cfg.dim, expert_width(cfg), knobs.expert_impl)
        self.shared: nn.Module | None = None
        if moe.shared_experts:  # one SwiGLU as wide as all shared experts together
            width = expert_width(cfg) * moe.shared_experts
            self.shared = shared_mlp(replace(cfg, ffn_dim=width, mlp="swiglu", bias=False))
        self.register_buffer("expert_bias", torch.zeros(moe.experts))  # in the checkpoint
        # routed and dropped (token, expert) picks since the last `balance_step`: not checkpointed
        self.register_buffer("tokens_per_expert", torch.zeros(moe.experts), persistent=False)
        self.register_buffer("dropped", torch.zeros(()), persistent=False)

    def reset_buffers(self) -> None:
        for buf in (self.expert_bias, self.tokens_per_expert, self.dropped):
            buf.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = F.linear(flat.float(), local(self.router).float())  # routing in fp32
        scores = logits.sigmoid() if self.score == "sigmoid" else logits.softmax(-1)
        if self.force_balance:
            idx, host = balanced_picks(flat.shape[0], self.top_k, self.n_experts, flat.device)
        else:
            choose = scores + self.expert_bias if self.balance == "bias" else scores
            idx, host = choose.topk(self.top_k, dim=-1).indices, None
        weights = scores.gather(1, idx)
        weights = weights / weights.sum(-1, keepdim=True)
        y = self.route(flat, idx, weights.to(x.dtype), host)
        if self.shared is not None:
            y = y + self.shared(flat)
        y = y.view(shape)
        if torch.is_grad_enabled():
            y = self._aux_losses(y, scores, idx, shape)
        return y

    def _aux_losses(self, y: torch.Tensor, scores: torch.Tensor, idx: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        batch, seq = (shape[0], shape[1]) if len(shape) == 3 else (1, shape[0])
        aux = scores.new_zeros(())
        if self.aux_coef:
            whole = balance_loss(scores.view(1, -1, self.n_experts), idx.view(1, -1, self.top_k), self.n_experts)
            aux = aux + self.aux_coef * whole
        if self.seq_aux_coef:
            per_seq = balance_loss(scores.view(batch, seq, -1), idx.view(batch, seq, -1), self.n_experts)
            aux = aux + self.seq_aux_coef * per_seq
        return _AddAuxLoss.apply(y, aux, self.aux_scale) if aux.requires_grad else y

    def route(
        self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, host: list[int] | None = None
    ) -> torch.Tensor:
        """Send each token to its top-k experts, sum their outputs weighted by the gates. `host`: each expert's
        picks, known on the host (force_balance): no count is read from a tensor."""
        tokens, k = idx.shape
        expert = idx.reshape(-1)
        token = torch.arange(tokens, device=x.device).repeat_interleave(k)
        gate = weights.reshape(-1)
        order = expert.argsort(stable=True)  # grouped by expert, in token order inside a group
        expert, token, gate = expert[order], token[order], gate[order]
        capacity = expert_capacity(self.capacity_factor, tokens, k, self.n_experts)
        if host is None:
            counts = torch.bincount(expert, minlength=self.n_experts)
            routed = counts.sum()
            if capacity is not None:  # each expert keeps its first `capacity` tokens
                starts = torch.cumsum(counts, 0) - counts
                keep = torch.arange(expert.numel(), device=x.device) - starts[expert] < capacity
                expert, token, gate = expert[keep], token[keep], gate[keep]
                counts = counts.clamp(max=capacity)
        else:  # force_balance: the same, from counts known on the host
            routed = tokens * k
            token, gate, counts, host = balanced_capacity(token, gate, host, capacity)
        if torch.is_grad_enabled() and not in_backward():  # training forward (not a recompute)
            self.tokens_per_expert += counts
            self.dropped += routed - counts.sum()
        out = self._experts(x[token], counts, host)
        return _Combine.apply(out, gate, token, x.shape, x.dtype)

    def _experts(self, x: torch.Tensor, counts: torch.Tensor, host: list[int] | None = None) -> torch.Tensor:
        if self.exchange is None:
            return self.experts(x, counts.tolist() if host is None else host)
        return self.exchange(x, counts, host=host)


def expert_capacity(factor: float | None, tokens: int, k: int, experts: int) -> int | None:
    """The picks each expert keeps under `capacity_factor`; None: dropless."""
    return None if factor is None else math.ceil(factor * tokens * k / experts)


def balanced_picks(tokens: int, k: int, experts: int, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """force_balance: token t's pick j is expert (t*k + j) % experts (k <= experts: a token's picks differ). The
    picks (tokens, k), and each expert's count, on the host: as even as tokens x k allows, the first ones one more."""
    picks = tokens * k
    idx = torch.arange(picks, device=device).remainder(experts).view(tokens, k)
    return idx, [picks // experts + (e < picks % experts) for e in range(experts)]


def balanced_capacity(
    token: torch.Tensor, gate: torch.Tensor, host: list[int], capacity: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """force_balance's picks grouped by expert (`host` of each), each expert's first `capacity` kept (None:
    dropless): the kept (token, gate), their counts as a tensor and on the host. Which rows stay is host
    arithmetic: each kept row's place among the grouped ones is its place among the kept plus the rows its
    expert's predecessors dropped (no mask, whose kept count a fake tensor cannot know)."""
    kept = host if capacity is None else [min(c, capacity) for c in host]
    counts = torch.tensor(kept, device=token.device)
    if kept == host:
        return token, gate, counts, kept
    shift = [s - t for s, t in zip(accumulate(host, initial=0), accumulate(kept, initial=0))][:-1]
    dropped_before = torch.tensor(shift, device=token.device)
    rows = sum(kept)
    where = torch.arange(rows, device=token.device) + dropped_before.repeat_interleave(counts, output_size=rows)
    return token[where], gate[where], counts, kept


def moe_layers(parts: list[nn.Module]) -> list[MoE]:
    return [m for part in parts for m in part.modules() if isinstance(m, MoE)]


def moe_counters(layers: list[MoE]) -> list[torch.Tensor]:
    return [torch.cat([m.tokens_per_expert, m.dropped.view(1)]) for m in layers]


@torch.no_grad()
def discount(layers: list[MoE], before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    """Take back what the layers counted between two `moe_counters` snapshots."""
    for m, b, a in zip(layers, before, after):
        m.tokens_per_expert -= (a - b)[:-1]
        m.dropped -= (a - b)[-1]


@torch.no_grad()
def balance_step(
    layers: list[MoE],
    sum_over_data: Callable[[torch.Tensor], torch.Tensor],
    sum_over_stages: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device | None = None,
    table: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """After an optimizer step: token counts summed over the data-parallel ranks (`sum_over_data`),
    the selection biases moved by gamma (`bias_update_rate`) towards balance (balance=bias), the counts reset; the
    metrics over every MoE layer of every pipeline stage (`sum_over_stages`). Every stage of a MoE
    model calls this, also one holding only dense layers (`first_dense_layers`): it adds zeros to
    the sum over stages (on `device`), which every stage must join. `table` = (n_layers, experts):
    also "moe_layers", every MoE layer's load as plain numbers (`layer_records`, launcher/model/moe_table.py),
    in the same sum."""
    size = 5 + (table[0] * (table[1] + EXTRA) if table else 0)
    totals = _stage_totals(layers, sum_over_data, table) if layers else torch.zeros(size, device=device)
    totals = sum_over_stages(totals)
    imbalance, bias, dropped, picks, n = totals[:5].tolist()  # one read back
    metrics: dict[str, Any] = {
        "moe_load_imbalance": imbalance / n,
        "moe_bias_abs_mean": bias / n,
        "moe_dropped_share": dropped / max(picks, 1.0),
    }
    if table:
        metrics["moe_layers"] = layer_records(totals[5:].view(table[0], -1))
    return metrics


def _stage_totals(
    layers: list[MoE], sum_over_data: Callable[[torch.Tensor], torch.Tensor], table: tuple[int, int] | None
) -> torch.Tensor:
    """Biases moved, counters reset; this stage's (imbalance sum, |bias| mean sum, dropped, picks, layers),
    then its layers' rows of `table` (`layer_rows`)."""
    counts = sum_over_data(torch.stack(moe_counters(layers)))  # per layer: tokens per expert, then dropped
    dropped, counts = counts[:, -1], counts[:, :-1]
    mean = counts.mean(1, keepdim=True)
    for m, c in zip(layers, counts):
        if m.balance == "bias":
            m.expert_bias += m.bias_rate * torch.sign(c.mean() - c)  # up if under-loaded, down if over
        m.tokens_per_expert.zero_()
        m.dropped.zero_()
    imbalance = (counts.max(1).values / mean[:, 0].clamp(min=1e-9)).sum()
    bias = torch.stack([m.expert_bias.abs().mean() for m in layers]).sum()
    picks = counts.sum() + dropped.sum()
    scalars = torch.stack([imbalance, bias, dropped.sum(), picks, counts.new_tensor(float(len(layers)))])
    rows = layer_rows(layers, counts, dropped, table) if table else counts.new_zeros(0)
    return torch.cat([scalars, rows.flatten()])
