"""One decoder-only transformer for the Llama and GPT-2 families, chosen by config.

Read top to bottom: norms, MLP (SwiGLU or GELU), block (pre- or post-norm), model; attention and
positions (rotary or learned) are model/attention.py's. Nothing here knows how the model is cut
(launcher/parallel/): tensor parallelism shards heads and hidden widths without changes here;
context parallelism and zero-bubble schedules swap in their own modules; a pipeline stage is this
model with the parts other stages hold deleted (names stay stable, so checkpoints load across layouts).
What a run changes in how it computes (loss chunks, kernels, scales) the constructor takes (`Knobs`);
what a batch carries beside its tokens (document ids) forward does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from launcher.config.model import ModelConfig
from launcher.flops import head_dim
from launcher.model.attention import Attention, Positions, rope_tables
from launcher.model.documents import attention_mask, document_positions
from launcher.model.knobs import PLAIN, Knobs
from launcher.model.moe import MoE, is_moe_layer
from launcher.ops.fused import FusedLinear
from launcher.ops.loss import OutputLoss
from launcher.ops.pointwise import swiglu


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
    return nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)


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
    def __init__(self, cfg: ModelConfig, layer: int = 0, knobs: Knobs = PLAIN) -> None:
        super().__init__()
        self.pre_norm = cfg.norm_position == "pre"
        self.attention_norm = make_norm(cfg)
        self.attention = Attention(cfg)
        self.ffn_norm = make_norm(cfg)
        moe = is_moe_layer(cfg, layer)
        self.feed_forward = MoE(cfg, FeedForward, layer, knobs) if moe else FeedForward(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None, mask: Any = None) -> torch.Tensor:
        if self.pre_norm:  # residual stream never normalised: gradients reach early layers intact
            x = x + self.dropout(self.attention(self.attention_norm(x), rope, mask))
            return x + self.dropout(self.feed_forward(self.ffn_norm(x)))
        # post-norm (original Transformer / BERT): the norm sits on the residual path
        x = self.attention_norm(x + self.dropout(self.attention(x, rope, mask)))
        return self.ffn_norm(x + self.dropout(self.feed_forward(x)))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, knobs: Knobs = PLAIN) -> None:
        super().__init__()
        self.cfg = cfg
        self.flop_per_byte = knobs.flop_per_byte  # the chunked loss's chunk size (flops.loss_chunk_rows)
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings: nn.Embedding | None = (
            nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.positions == "learned" else None
        )
        self.positions = Positions()
        self.layers = nn.ModuleDict({str(i): Block(cfg, i, knobs) for i in range(cfg.n_layers)})
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
        `documents` (batch, seq): each token's document id under document masking (model/documents.py),
        for per-document positions and attention; None: plain causal."""
        within = None if documents is None else document_positions(documents)
        h = tokens if self.tok_embeddings is None else self.embed(tokens, within)
        rope = self.rope
        if rope is not None:
            rope = self.positions(rope, 1) if within is None else rope[:, within]
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

    def embed(self, tokens: torch.Tensor, within: torch.Tensor | None) -> torch.Tensor:
        """Token embeddings, plus learned position embeddings: at each token's position `within` its
        document, else at the local tokens' positions in their sequence."""
        h = self.tok_embeddings(tokens)
        if self.pos_embeddings is None:
            return h
        if within is None:
            every = torch.arange(self.cfg.max_seq_len, device=tokens.device)
            within = self.positions(every, 0)[: tokens.shape[1]]
        return h + self.pos_embeddings(within)
