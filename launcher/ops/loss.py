"""Cross-entropy of the output projection without the full logits: chunks of tokens at a time.

`F.cross_entropy(output(h))` keeps the (tokens, vocab) logits, in fp32, alive from forward to backward
(and writes and reads them several times). Here the output projection and the loss run together over
chunks of `rows` tokens; each chunk's gradients (with respect to the hidden states and the output
weight) are computed in the forward, while its logits are at hand, and only they are kept
(Liger-Kernel's fused linear cross-entropy, in plain PyTorch). Same FLOPs as the unchunked loss, no
recomputation; memory: one chunk of logits instead of all of them.

Every chunk re-reads the output weight and adds into its fp32 gradient, so the chunk size is set by
the device (`flops.loss_chunk_rows`, which the planner reads too): rows enough that a chunk's matmuls
outlast that traffic. On an H200 a `1b` step runs 8 chunks of 2048 tokens (128K vocabulary), where
fixed 16 MiB chunks of 32 tokens made 512 and moved 2.2 TB.

Under tensor parallelism each rank holds a slice of the vocabulary (`Vocab` says which): a chunk's
log-sum-exp and target logit then combine across the ranks as per-token scalars
(launcher/parallel/vocab.py), and the logits are never whole on any rank, even a chunk's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

from launcher.flops import loss_chunk_rows

# Inside `token_losses()`: where each loss computed also leaves its per-token values (detached)
_RECORDING: ContextVar[list[torch.Tensor] | None] = ContextVar("token_losses", default=None)


@contextlib.contextmanager
def token_losses() -> Iterator[list[torch.Tensor]]:
    """Every loss computed inside (this chunked one, the runners' `cross_entropy`) appends its
    per-token losses, in order, to the list: figures per sequence (per source) without another pass."""
    recorded: list[torch.Tensor] = []
    reset = _RECORDING.set(recorded)
    try:
        yield recorded
    finally:
        _RECORDING.reset(reset)


def recording() -> bool:
    return _RECORDING.get() is not None


def record(per_token: torch.Tensor) -> None:
    """Keep per-token losses when recording (a no-op otherwise)."""
    recorded = _RECORDING.get()
    if recorded is not None:
        recorded.append(per_token.detach().flatten().float())


class Vocab:
    """The whole vocabulary on this rank: a chunk's log-sum-exp and target logits are its own."""

    def lse_and_target(
        self, logits: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per token: the log-sum-exp over the vocabulary, the target's logit, and the target's column
        in `logits` (-1 where another rank holds it)."""
        return logits.logsumexp(-1), logits.gather(1, targets[:, None]).squeeze(1), targets


WHOLE = Vocab()


def _chunk(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab: Vocab
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token losses, d loss / d logits) of one chunk: logits in fp32, softmax minus the one-hot."""
    logits = (h @ weight.t()).float()
    lse, target, cols = vocab.lse_and_target(logits, targets)
    grad = logits.sub_(lse[:, None]).exp_()  # the softmax, in place of the logits
    here = (cols >= 0).to(grad.dtype)  # minus the one-hot where this rank holds the target (no host sync)
    grad.scatter_add_(1, cols.clamp(min=0)[:, None], -here[:, None])
    return lse - target, grad


class LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of `h @ weight.T` (tokens, vocab) against `targets`, chunk by chunk."""

    @staticmethod
    def forward(
        ctx: Any,
        h: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        rows: int,
        need_grad: bool,
        dtype: torch.dtype,
        vocab: Vocab,
    ) -> torch.Tensor:
        x, w = h.to(dtype), weight.to(dtype)  # `dtype`: autocast's, chosen outside (autocast is off in here)
        n = h.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(x) if need_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_grad else None
        per_token = [] if recording() else None
        for lo in range(0, n, rows):
            hi = min(lo + rows, n)
            loss, grad = _chunk(x[lo:hi], w, targets[lo:hi], vocab)
            total += loss.sum()
            if per_token is not None:
                per_token.append(loss)
            if grad_h is not None and grad_w is not None:
                grad = grad.to(dtype)
                grad_h[lo:hi] = grad @ w
                if dtype == torch.float32:
                    grad_w.addmm_(grad.t(), x[lo:hi])
                else:  # the matmul in the low precision, the sum over chunks in fp32
                    grad_w += grad.t() @ x[lo:hi]
        if per_token is not None:
            record(torch.cat(per_token))
        if grad_h is not None and grad_w is not None:
            ctx.save_for_backward(grad_h.to(h.dtype), grad_w.to(weight.dtype))
        ctx.n = n
        return total / n

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_out / ctx.n
        return grad_h * scale.to(grad_h.dtype), grad_w * scale.to(grad_w.dtype), None, None, None, None, None


def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int, vocab: Vocab = WHOLE
) -> torch.Tensor:
    """Mean token loss of the logits `h @ weight.T`, never holding them whole, `rows` tokens at a time:
    h (..., dim), targets (...); `weight` this rank's `vocab` rows."""
    need_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    device = h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
    with torch.autocast(device, enabled=False):
        return LinearCrossEntropy.apply(h.flatten(0, -2), weight, targets.flatten(), rows, need_grad, dtype, vocab)


class OutputLoss(nn.Module):
    """The output projection and the mean token loss together, chunked (no parameters: the model passes
    its output weight). Tensor parallelism swaps in its vocabulary-parallel twin (parallel/vocab.py)."""

    def forward(
        self, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, flop_per_byte: float
    ) -> torch.Tensor:
        rows = loss_chunk_rows(targets.numel(), weight.shape[0], flop_per_byte)
        return linear_cross_entropy(h, weight, targets, rows)
