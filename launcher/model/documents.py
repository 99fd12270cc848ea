"""Document masking (`data.document_mask=true`): a packed sequence holds several documents, each token
attends only to the tokens before it in its own document, and positions restart at each document.

Boundaries come from the token stream itself: every source writes a document as [BOS] tokens EOS, so
a document starts at the sequence's first token and after every EOS (`document_ids`): no extra data
travels with a batch. The first document of a sequence is usually the tail of one cut by the
sequence's start; its positions start at 0 there, as they would for any packed sequence.

Two masks, one rule (`same document and not after the query`): on CPU an additive (batch, 1, seq, seq)
tensor for SDPA (0 or -inf in the compute dtype: SDPA's CPU flash kernel runs it faster than a
boolean one), the correctness path (flex attention has no CPU backward in torch 2.13); on CUDA
FlexAttention's block mask, whose kernel skips the blocks no query of a document sees, so the work
follows the sum of squared document lengths rather than seq^2 (launcher/flops.py counts it so).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
import torch.nn.functional as F


def document_ids(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """(batch, seq) token ids → (batch, seq) document number of each token within its sequence."""
    starts = torch.zeros_like(tokens, dtype=torch.long)
    starts[:, 1:] = tokens[:, :-1] == eos
    return starts.cumsum(1)


def document_positions(docs: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document: its index minus its document's first index."""
    index = torch.arange(docs.shape[1], device=docs.device).expand_as(docs)
    first = torch.ones_like(docs, dtype=torch.bool)
    first[:, 1:] = docs[:, 1:] != docs[:, :-1]
    return index - torch.where(first, index, 0).cummax(1).values


def dense_mask(docs: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) boolean: True where the query (row) may attend to the key (column)."""
    s = docs.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=docs.device).tril()
    return ((docs[:, :, None] == docs[:, None, :]) & causal)[:, None]


@cache
def _compiled_block_mask() -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


def block_mask(docs: torch.Tensor, compiled: bool | None = None) -> Any:
    """FlexAttention's block mask of the same rule (heads broadcast: tensor parallelism's split needs none).
    `compiled` (default: on CUDA): eager `create_block_mask` evaluates the rule for every (query, key) pair
    at once, (batch, seq, seq) int64 gathers and more (2.6 GiB at 1 x 16384 here, growing as seq²); compiled, block
    by block (compiled once per shape: 7 s here, 0.1 s a call after)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def visible(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (docs[b, q] == docs[b, k]) & (q >= k)

    build = _compiled_block_mask() if (docs.is_cuda if compiled is None else compiled) else create_block_mask
    b, s = docs.shape
    return build(visible, b, None, s, s, device=docs.device)


def attention_mask(docs: torch.Tensor, flex: bool, dtype: torch.dtype = torch.float32) -> Any:
    """The mask the attention core takes: a block mask with `flex` (CUDA), else the dense one, additive
    in `dtype` (the activations'; under autocast SDPA casts it with q, k and v)."""
    if flex:
        return block_mask(docs)
    return torch.zeros((), dtype=dtype, device=docs.device).masked_fill(~dense_mask(docs), float("-inf"))


@cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)  # eager flex attention materialises the scores


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, dropout: float) -> torch.Tensor:
    """Attention of (batch, heads, seq, head_dim) inputs under a document mask (GQA heads unexpanded)."""
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, enable_gqa=gqa)
    flex = _compiled_flex() if q.device.type == "cuda" else _eager_flex()
    return flex(q, k, v, block_mask=mask, enable_gqa=gqa)


def _eager_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention
