"""One decoder-only transformer for the Llama and GPT-2 families, chosen by config.

Read top to bottom: norms, positions (rotary or learned), attention (GQA), MLP (SwiGLU or GELU),
block (pre- or post-norm), model. Nothing here knows how the model is cut (launcher/parallel/):
tensor parallelism shards heads and hidden widths without changes here, as head counts follow from
the projected width (`view(..., -1, head_dim)`); context parallelism and zero-bubble schedules swap
in their own `Positions`, `CausalAttention` and `FusedLinear` modules; a pipeline stage is this model
with the parts other stages hold deleted (names stay stable, so checkpoints load across layouts).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from launcher.config.schema import ModelConfig
from launcher.flops import head_dim, kv_heads
from launcher.model.documents import attention_mask, document_ids, document_positions, masked_attention
from launcher.model.moe import MoE, is_moe_layer
from launcher.ops.fused import FusedLinear
from launcher.ops.loss import OutputLoss
from launcher.ops.pointwise import rotary_qkv, split_heads, swiglu


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


class Positions(nn.Module):
    """Which positions of its sequence each local token holds: here the first ones, in order, so a
    table indexed by position (RoPE's angles, learned position embeddings) is read from its first
    row. Context parallelism swaps in its rank's positions (launcher/parallel/context.py)."""

    def forward(self, table: torch.Tensor, dim: int) -> torch.Tensor:
        """`table`'s rows along `dim` in the local tokens' order (as many as a consumer reads)."""
        return table


class CausalAttention(nn.Module):
    """The attention core: each query attends to the keys up to its own position, or, with a document
    `mask`, to those of its own document (model/documents.py). GQA's query heads share K/V heads
    without repeating them. Context parallelism swaps in its own."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None) -> torch.Tensor:
        dropout = self.dropout if self.training else 0.0
        if mask is not None:
            return masked_attention(q, k, v, mask, dropout)
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, enable_gqa=gqa)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = head_dim(cfg)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=cfg.bias)
        self.wk = nn.Linear(cfg.dim, kv_heads(cfg) * self.head_dim, bias=cfg.bias)
        self.wv = nn.Linear(cfg.dim, kv_heads(cfg) * self.head_dim, bias=cfg.bias)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=cfg.bias)
        self.qkv = FusedLinear()  # wq, wk and wv as one matmul (ops/fused.py)
        self.core = CausalAttention(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None, mask: Any = None) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x, self.wq, self.wk, self.wv)
        # each projection's share of the product: under tensor parallelism the same part of each
        widths = [lin.weight.shape[0] for lin in (self.wq, self.wk, self.wv)]
        widths = [w * qkv.shape[-1] // sum(widths) for w in widths]
        # (batch, heads, seq, head_dim): SDPA's fast path wants 4-D inputs
        if rope is not None:
            q, k, v = rotary_qkv(qkv, rope, widths, self.head_dim)
        else:
            q, k, v = split_heads(qkv, widths, self.head_dim)
        return self.wo(self.core(q, k, v, mask).transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x). GELU: w2(gelu(w1 x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.bias)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=cfg.bias)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.bias) if cfg.mlp == "swiglu" else None
        self.gate_up = FusedLinear() if self.w3 is not None else None  # w1 and w3 as one matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            return self.w2(swiglu(self.gate_up(x, self.w1, self.w3)))
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

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None, mask: Any = None) -> torch.Tensor:
        if self.pre_norm:  # residual stream never normalised: gradients reach early layers intact
            x = x + self.dropout(self.attention(self.attention_norm(x), rope, mask))
            return x + self.dropout(self.feed_forward(self.ffn_norm(x)))
        # post-norm (original Transformer / BERT): the norm sits on the residual path
        x = self.attention_norm(x + self.dropout(self.attention(x, rope, mask)))
        return self.ffn_norm(x + self.dropout(self.feed_forward(x)))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # the device's FLOP per byte, which sizes the chunked loss's chunks (flops.loss_chunk_rows); set by
        # `parallelize` from BuildOptions.flop_per_byte; 0: chunks of 16 MiB of logits
        self.flop_per_byte = 0.0
        # data.document_mask: the id that ends each document (set by `parallelize`); None: plain causal
        self.document_eos: int | None = None
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings: nn.Embedding | None = (
            nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.positions == "learned" else None
        )
        self.positions = Positions()
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = make_norm(cfg) if cfg.norm_position == "pre" else None
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.output_loss = OutputLoss()  # with targets: the projection and the loss in chunks (ops/loss.py)
        self.register_buffer("rope", self._rope_tables(), persistent=False)

    def _rope_tables(self) -> torch.Tensor | None:
        if self.cfg.positions != "rope":
            return None
        device = next(self.parameters()).device
        return rope_tables(head_dim(self.cfg), self.cfg.max_seq_len, self.cfg.rope_theta, device)

    def reset_buffers(self) -> None:
        """Recompute the RoPE tables on the parameters' device (built on meta, they hold nothing)."""
        if self.rope is not None:
            self.rope = self._rope_tables()

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens (batch, seq) → logits (batch, seq, vocab); a middle pipeline stage maps h → h.
        With `targets` (batch, seq): the mean token loss instead, computed in chunks (ops/loss.py)
        so the full logits never exist (inside forward: FSDP has the output weight gathered).
        Under document masking the tokens' document ids (`documents`; from the tokens on the first
        stage when not given): per-document positions and attention."""
        if documents is None and self.document_eos is not None and self.tok_embeddings is not None:
            documents = document_ids(tokens, self.document_eos)
        h, rope, every = tokens, self.rope, torch.arange(self.cfg.max_seq_len, device=tokens.device)
        if documents is not None:
            every = document_positions(documents)
            rope = None if rope is None else rope[:, every]
        elif rope is not None:
            rope = self.positions(rope, 1)
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
            if self.pos_embeddings is not None:
                rows = every if documents is not None else self.positions(every, 0)[: tokens.shape[1]]
                h = h + self.pos_embeddings(rows)
        mask = None if documents is None else attention_mask(documents, h.device.type == "cuda", h.dtype)
        for layer in self.layers.values():
            h = layer(h, rope, mask)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        if targets is not None:
            return self.output_loss(h, self.output.weight, targets, self.flop_per_byte)
        return self.output(h)
