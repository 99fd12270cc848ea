"""One decoder-only transformer for the Llama and GPT-2 families, chosen by config.

Read top to bottom: norms, rotary positions, attention (GQA), MLP (SwiGLU or GELU), block (pre- or
post-norm), model. Shapes are written so that tensor parallelism can shard heads and hidden widths
without changes here: head counts are inferred from the projected width (`view(..., -1, head_dim)`),
and a pipeline stage is the same model with some parts set to None (names stay stable, so
checkpoints load across layouts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from launcher.config import ModelConfig
from launcher.flops import loss_chunk_rows
from launcher.model.loss import linear_cross_entropy
from launcher.model.moe import MoE, is_moe_layer


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
    return nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)


def rope_tables(head_dim: int, seq_len: int, theta: float, device: torch.device) -> torch.Tensor:
    """cos and sin of the rotary angles, stacked: (2, seq_len, head_dim)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.stack([angles.cos(), angles.sin()])


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, heads, seq, head_dim) by the tables for the first `seq` positions."""
    seq = x.shape[-2]
    cos, sin = rope[0, :seq].to(x.dtype), rope[1, :seq].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, gqa: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, enable_gqa=gqa)


def _weight_grads(grad: torch.Tensor, x: torch.Tensor, dtype: torch.dtype, shapes: list, n_weights: int) -> list:
    """The gradients of the stacked weights, then biases, whose (shape, dtype) are `shapes`, from the
    product's gradient and its input."""
    g = grad.to(dtype).flatten(0, -2)
    rows = [shape[0] for shape, _ in shapes[:n_weights]]
    grad_w = (g.t() @ x.to(dtype).flatten(0, -2)).split(rows)
    grad_b = g.sum(0).split(rows) if n_weights < len(shapes) else ()
    return [gp.to(dt) for gp, (_, dt) in zip((*grad_w, *grad_b), shapes)]


class StackedLinear(torch.autograd.Function):
    """x @ [w_1; w_2; ...].T as one matmul. The stacked copy lives only inside forward and backward:
    autograd keeps x and the weights themselves (as separate `nn.Linear`s would), not a copy of them
    per layer (under FSDP, that copy would outlive the resharded weights until backward).
    `weight_grads`: one node gives x's and the weights' gradients; without it the weights come in
    detached and `StackedLinearWeights` gives theirs (zero-bubble schedules)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dtype: torch.dtype, weight_grads: bool, *weights: torch.Tensor) -> Any:
        ctx.save_for_backward(x if weight_grads else None, *weights)
        ctx.dtype, ctx.x_dtype = dtype, x.dtype
        ctx.shapes = [(w.shape, w.dtype) for w in weights]
        return x.to(dtype) @ torch.cat(weights).to(dtype).t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors  # unpacked once: checkpointing's saved-tensor hooks allow no more
        grad_x = (grad.to(ctx.dtype) @ torch.cat(weights).to(ctx.dtype)).to(ctx.x_dtype)
        if x is None:
            return grad_x, None, None, *(None for _ in weights)
        return grad_x, None, None, *_weight_grads(grad, x, ctx.dtype, ctx.shapes, len(weights))


class StackedLinearWeights(torch.autograd.Function):
    """The weights' (and biases') side of `StackedLinear` for zero-bubble schedules, as its own
    autograd node beside it: forward returns the biases (zero without) expanded to the output's shape,
    to be added to the product; backward computes the weights' gradients from the saved x (given
    detached) and the output's gradient. Two nodes, so a zero-bubble schedule's input pass (torch's
    stage_backward_input) runs only the x side and its weight pass only this one; one node would
    compute both in both passes. Elsewhere one node is cheaper: the add is a pass over the output."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dtype: torch.dtype, n_weights: int, *params: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.dtype, ctx.n_weights = dtype, n_weights
        ctx.shapes = [(p.shape, p.dtype) for p in params]
        weights, biases = params[:n_weights], params[n_weights:]
        width = sum(w.shape[0] for w in weights)
        bias = torch.cat(biases).to(dtype) if biases else x.new_zeros((), dtype=dtype)
        return bias.expand(*x.shape[:-1], width)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        return None, None, None, *_weight_grads(grad, x, ctx.dtype, ctx.shapes, ctx.n_weights)


def fused_linear(x: torch.Tensor, *linears: nn.Linear, split: bool = False) -> tuple[torch.Tensor, ...]:
    """`x` through several `nn.Linear`s that share it, as one matmul (x read once, one larger GEMM
    forward and one each for x's and the weights' gradients); returns each projection's output. The
    parameters stay separate, so names, checkpoints and the tensor-parallel plan are those of the
    unfused layers. Under tensor parallelism (weights Shard(0) DTensors, x a replicated DTensor) the
    stack is of the local shards, [q_r; k_r; v_r]: this rank's whole heads (hidden units) of each
    projection; x's gradient is then a partial sum, reduced where the replicated input came from
    (launcher/parallel/tensor.py). `split`: the weights' gradients in a node of their own (zero-bubble)."""
    weights = [lin.weight for lin in linears]
    biases = [lin.bias for lin in linears if lin.bias is not None]
    if isinstance(x, DTensor):
        x = x.to_local(grad_placements=[Partial()])
        weights = [w.to_local() for w in weights]
        biases = [b.to_local() for b in biases]
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    with torch.autocast(device, enabled=False):  # the Functions cast to autocast's dtype themselves
        if split:
            product = StackedLinear.apply(x, dtype, False, *(w.detach() for w in weights))
            out = product + StackedLinearWeights.apply(x.detach(), dtype, len(weights), *weights, *biases)
        else:
            out = StackedLinear.apply(x, dtype, True, *weights)
            out = out + torch.cat(biases).to(dtype) if biases else out
    return out.split([w.shape[0] for w in weights], dim=-1)


def split_weight_passes(model: nn.Module, split: bool = True) -> None:
    """The fused projections of `model` give their weights' gradients in nodes of their own (or not),
    for a zero-bubble schedule's separate input and weight passes."""
    for module in model.modules():
        if isinstance(module, (Attention, FeedForward)):
            module.split = split


class Attention(nn.Module):
    # the attention core; context parallelism swaps in its own (launcher/parallel/context.py)
    attend = staticmethod(causal_attention)
    split = False  # fused_linear's weight gradients in their own node (split_weight_passes)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim or cfg.dim // cfg.n_heads
        self.n_rep = cfg.n_heads // (cfg.n_kv_heads or cfg.n_heads)
        kv_width = (cfg.n_kv_heads or cfg.n_heads) * self.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=cfg.bias)
        self.wk = nn.Linear(cfg.dim, kv_width, bias=cfg.bias)
        self.wv = nn.Linear(cfg.dim, kv_width, bias=cfg.bias)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        b, s, _ = x.shape
        # (batch, heads, seq, head_dim): SDPA's fast path wants 4-D inputs
        q, k, v = (
            t.view(b, s, -1, self.head_dim).transpose(1, 2)
            for t in fused_linear(x, self.wq, self.wk, self.wv, split=self.split)
        )
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
            v = v.contiguous()  # SDPA saves v: a view of the fused output would keep pre-rotation q, k alive
        # GQA: query head i reads KV head i // n_rep, without materializing repeated K and V
        dropout = self.dropout if self.training else 0.0
        out = self.attend(q, k, v, dropout, self.n_rep > 1)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x). GELU: w2(gelu(w1 x))."""

    split = False  # as Attention.split

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.bias)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=cfg.bias)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.bias) if cfg.mlp == "swiglu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            gate, up = fused_linear(x, self.w1, self.w3, split=self.split)
            return self.w2(F.silu(gate) * up)
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.pre_norm = cfg.norm_position == "pre"
        self.attention_norm = make_norm(cfg)
        self.attention = Attention(cfg)
        self.ffn_norm = make_norm(cfg)
        self.feed_forward = MoE(cfg, FeedForward, layer) if is_moe_layer(cfg, layer) else FeedForward(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        if self.pre_norm:  # residual stream never normalised: gradients reach early layers intact
            x = x + self.dropout(self.attention(self.attention_norm(x), rope))
            return x + self.dropout(self.feed_forward(self.ffn_norm(x)))
        # post-norm (original Transformer / BERT): the norm sits on the residual path
        x = self.attention_norm(x + self.dropout(self.attention(x, rope)))
        return self.ffn_norm(x + self.dropout(self.feed_forward(x)))


class Transformer(nn.Module):
    # global positions of the local tokens, (device) -> (seq,); None: 0..seq-1. Set under context
    # parallelism, where a rank holds two chunks of each sequence (launcher/parallel/context.py)
    positions: Callable[[torch.device], torch.Tensor] | None = None
    # the device's FLOP per byte, which sizes the chunked loss's chunks (flops.loss_chunk_rows); set by
    # `parallelize` from the hardware profile; 0: chunks of 16 MiB of logits
    flop_per_byte: float = 0.0

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings: nn.Embedding | None = (
            nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.positions == "learned" else None
        )
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = make_norm(cfg) if cfg.norm_position == "pre" else None
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("rope", self._rope_tables(), persistent=False)

    def _rope_tables(self) -> torch.Tensor | None:
        if self.cfg.positions != "rope":
            return None
        device = next(self.parameters()).device
        return rope_tables(
            self.cfg.head_dim or self.cfg.dim // self.cfg.n_heads, self.cfg.max_seq_len, self.cfg.rope_theta, device
        )

    def tie_weights(self) -> None:
        """Share the embedding with the output projection again, after anything that replaced parameters
        (tensor parallelism, `to_empty`); a pipeline stage holding only one of them has nothing to tie."""
        if self.cfg.tied_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight

    def reset_buffers(self) -> None:
        """Recompute the RoPE tables on the parameters' device (built on meta, they hold nothing)."""
        if self.rope is not None:
            self.rope = self._rope_tables()

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (batch, seq) → logits (batch, seq, vocab); a middle pipeline stage maps h → h.
        With `targets` (batch, seq): the mean token loss instead, computed in chunks (model/loss.py)
        so the full logits never exist (inside forward: FSDP has the output weight gathered)."""
        h, rope = tokens, self.rope
        pos = self.positions(tokens.device) if self.positions is not None else None
        if rope is not None and pos is not None:
            rope = rope[:, pos]
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
            if self.pos_embeddings is not None:
                h = h + self.pos_embeddings(torch.arange(tokens.shape[1], device=tokens.device) if pos is None else pos)
        for layer in self.layers.values():
            h = layer(h, rope)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        if targets is not None:
            rows = loss_chunk_rows(targets.numel(), self.output.weight.shape[0], self.flop_per_byte)
            return linear_cross_entropy(h, self.output.weight, targets, rows)
        return self.output(h)
