"""Attention, read top to bottom: the rotary tables, which positions the local tokens hold, the causal
core (plain, or within documents: model/documents.py) and the GQA projections around it. Tensor
parallelism shards heads without changes here, as head counts follow from the projected width
(`view(..., -1, head_dim)`); context parallelism swaps in its own `Positions` and `CausalAttention`
(launcher/parallel/context.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from launcher.config.model import ModelConfig
from launcher.flops import head_dim, kv_heads
from launcher.model.documents import masked_attention
from launcher.ops.fused import FusedLinear
from launcher.ops.pointwise import rotary_qkv, split_heads


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
