"""Selective recompute's policy (launcher/parallel/recompute.py) on document-masked attention: FlexAttention's
higher-order op is saved like SDPA's kernels, so backward never reruns it.

Torch 2.13 refuses flex attention's backward on the CPU at its public entry (`_validate_device`); the op's
own eager forward and backward run here, so the tests lift that check and run the CUDA path's op on the CPU.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from launcher.model.documents import attention_mask, block_mask, document_ids, masked_attention
from launcher.parallel import recompute

FLEX = torch.ops.higher_order.flex_attention


class OpRuns(TorchDispatchMode):
    """How many times each op (higher-order ones included) runs inside `with OpRuns():`."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.runs: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.runs[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def flex_backward_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Flex attention's eager backward on the CPU (its public entry refuses it on 2.13), the op called as it is
    (eager flex otherwise wraps it in `torch.compile`, which refuses to trace under a counting dispatch mode)."""
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_validate_device", lambda *tensors: None)
    monkeypatch.setattr(flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        yield


def test_both_policies_keep_flex_attentions_output() -> None:
    assert FLEX in recompute.ATTENTION_OPS and FLEX in recompute.SAVE_OPS
    assert recompute.policy(None, FLEX) == CheckpointPolicy.MUST_SAVE
    assert recompute.keep_attention(None, FLEX) == CheckpointPolicy.MUST_SAVE  # full recompute, compiled on 2.13


def masked_block(q: torch.Tensor, mask: Any) -> torch.Tensor:
    """Pointwise work around document-masked attention, as a block's (recomputed: cheap)."""
    return masked_attention(q.sin(), q.cos(), q, mask, 0.0).tanh()


def test_selective_recompute_runs_flex_attention_once(
    flex_backward_on_cpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A selectively checkpointed block calls flex once in forward; backward reruns the pointwise ops
    but not flex (its saved output is used), and the gradient is the plain one, bit for bit."""
    decided: Counter[Any] = Counter()

    def counted(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        decided[op] += 1
        return policy(ctx, op, *args, **kwargs)

    policy = recompute.policy
    monkeypatch.setattr(recompute, "policy", counted)
    tokens = torch.tensor([[5, 0, 7, 7, 0, 3, 3, 3] * 16, [1] * 64 + [0] + [2] * 63])  # 0 ends a document
    docs = document_ids(tokens, 0)
    mask = block_mask(docs)
    q = torch.randn(2, 2, 128, 16, requires_grad=True)
    out = recompute._checkpointed(masked_block, True, q, mask)
    assert decided[FLEX] == 1  # forward: flex ran once, and was decided on
    with OpRuns() as backward:
        out.sum().backward()
    assert backward.runs["aten.tanh.default"] == 1, backward.runs  # the checkpoint did recompute the block
    assert backward.runs["flex_attention"] == 0, backward.runs  # ... but not its attention
    assert backward.runs["flex_attention_backward"] == 1
    plain = torch.autograd.grad(masked_block(q, mask).sum(), q)[0]
    assert torch.equal(q.grad, plain)
    dense = attention_mask(docs, flex=False)  # the CPU path's kernel (SDPA) agrees
    assert torch.allclose(plain, torch.autograd.grad(masked_block(q, dense).sum(), q)[0], atol=1e-5)
