"""The step runners `parallelize` returns: the rank's model parts plus the three operations the
training loop needs (forward+backward over a step's batch, evaluation, gradient clipping). The loop
never sees how the model is cut. Every runner returns the global mean loss (the same float on every
rank), and the global gradient norm.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from launcher.compat.pipeline_compat import forward_only
from launcher.compat.torch_compat import foreach_mul_, foreach_norm
from launcher.layout import Layout
from launcher.model.documents import document_ids
from launcher.model.moe import MoE, balance_step, discount, moe_counters, moe_layers
from launcher.ops.experts import local
from launcher.ops.loss import record, recording, token_losses
from launcher.parallel.data import set_gradient_sync
from launcher.parallel.pipeline import build_schedule
from launcher.parallel.tensor import loss_context
from launcher.parallel.tied import output_copies, sum_tied_grads, tie_group, tied_copies


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token loss; with vocabulary-sharded DTensor logits this must run under `loss_context`.
    Under `loss.token_losses()` the per-token losses are kept too (the same mean, one reduction later)."""
    if not recording():
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    per_token = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    record(per_token.full_tensor() if isinstance(per_token, DTensor) else per_token)
    return per_token.mean()


def _scalar(value: torch.Tensor) -> float:
    return local(value).item()


class Runner:
    """One process, no parallelism: gradient accumulation over micro-batches of `micro` sequences
    (the loader hands each rank `layout.microbatches` of them per step). `document_eos`
    (data.document_mask): the id ending each document, from which each batch's document ids are the
    model's forward input (model/documents.py); None: plain causal."""

    fp8: dict[str, Any] | None = None  # dtype=fp8: the layers converted and kept (launcher/parallel/float8.py)
    compiled_units: int = 0  # modules torch.compile'd on this rank (launcher/parallel/compiled.py)

    def __init__(
        self, model: nn.Module, micro: int, autocast: torch.autocast | None = None, document_eos: int | None = None
    ) -> None:
        self.parts: list[nn.Module] = [model]
        self.model = model
        self.micro = micro
        self.autocast = autocast
        self.document_eos = document_eos
        self.local_loss = 0.0  # this rank's own mean loss of the last pass, before the mean over ranks

    @functools.cached_property
    def stage_moe(self) -> list[list[MoE]]:
        """Each part's MoE layers, found once (the loop asks every step; empty for a dense model)."""
        return [moe_layers([part]) for part in self.parts]

    @property
    def moe(self) -> list[MoE]:
        return [m for layers in self.stage_moe for m in layers]

    @property
    def moe_model(self) -> bool:
        """Whether the model has MoE layers, on this stage or another (a stage may hold only dense ones)."""
        return self.model.cfg.moe.experts > 0

    def _autocast(self) -> contextlib.AbstractContextManager:
        return self.autocast or contextlib.nullcontext()

    def documents(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The inputs' document ids under document masking (model/documents.py), else None."""
        return None if self.document_eos is None else document_ids(inputs, self.document_eos)

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self._autocast():  # output projection and loss together, in chunks (ops/loss.py; under tp
            return self.model(inputs, targets, self.documents(inputs))  # over the vocabulary shards: parallel/vocab.py)

    def microbatches(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batch as the microbatches it runs, `micro` sequences each."""
        return list(zip(inputs.split(self.micro), targets.split(self.micro)))

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Accumulate gradients of the mean loss over this rank's batch; return that mean loss."""
        chunks = self.microbatches(inputs, targets)
        total = torch.zeros((), dtype=torch.float64, device=inputs.device)
        for x, y in chunks:
            loss = self._loss(x, y) / len(chunks)
            loss.backward()
            total += loss.detach()  # on the device: one host sync per step, not per micro-batch
        self.local_loss = total.item()
        return self.local_loss

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        losses = [self._loss(x, y).item() for x, y in self.microbatches(inputs, targets)]
        return sum(losses) / len(losses)

    def source_sums(self, per_token: list[torch.Tensor], sources: torch.Tensor, k: int) -> torch.Tensor:
        """(k, 2) float64: each of k sources' summed token loss and token count over the pass's batch on
        every rank, from the per-token losses it recorded (`loss.token_losses`) for this rank's sequences,
        whose sources are `sources`; each sequence has one source, so a sum per sequence is enough."""
        device = next(p for part in self.parts for p in part.parameters()).device
        table = torch.zeros(k, 2, dtype=torch.float64, device=device)
        if per_token:  # none on a pipeline stage without the loss
            per_sequence = torch.cat(per_token).double().view(len(sources), -1)
            ids = sources.to(device)
            table[:, 0].index_add_(0, ids, per_sequence.sum(1))
            table[:, 1].index_add_(0, ids, per_sequence.new_full((len(sources),), per_sequence.shape[1]))
        return self._over_ranks(table)

    def _over_ranks(self, table: torch.Tensor) -> torch.Tensor:
        return table

    @property
    def moe_shape(self) -> tuple[int, int]:
        """(layers, experts) of the whole model: the per-layer load table every stage agrees on."""
        return self.model.cfg.n_layers, self.model.cfg.moe.experts

    def update_balance(self, per_layer: bool = False) -> dict[str, Any]:
        """After the optimizer step: MoE routing biases moved towards balance; the balance metrics,
        and with `per_layer` each MoE layer's load ("moe_layers")."""
        if not self.moe_model:
            return {}
        return balance_step(self.moe, lambda t: t, lambda t: t, table=self.moe_shape if per_layer else None)

    def clip_grad_norm(self, max_norm: float) -> float:
        params = [p for part in self.parts for p in part.parameters()]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf")))


class DistributedRunner(Runner):
    """Shared by the parallel runners: global loss and gradient norm over the mesh."""

    def __init__(
        self, parts: list[nn.Module], micro: int, autocast: Any, mesh: Any, layout: Layout, document_eos: int | None
    ) -> None:
        super().__init__(parts[0], micro, autocast, document_eos)
        self.parts = parts
        self.mesh = mesh
        self.layout = layout
        self.device = next(p for part in parts for p in part.parameters()).device
        self.norm_skips: set[int] = set()  # ids of copies whose gradient another parameter counts

    def _all_reduce(self, value: torch.Tensor, dims: tuple[str, ...]) -> torch.Tensor:
        for dim in dims:
            if self.mesh[dim].size() > 1:
                dist.all_reduce(value, group=self.mesh.get_group(dim))
        return value

    def _global_mean(self, local: float | torch.Tensor, has_loss: bool = True) -> float:
        """This rank's mean loss → the mean over data- and context-parallel ranks (each cp rank's over
        the same number of tokens), known to every rank."""
        self.local_loss = float(local) if has_loss else 0.0
        value = torch.as_tensor(local if has_loss else 0.0, dtype=torch.float64, device=self.device).reshape(1)
        dims = ("pp", "dp_replicate", "dp_shard", "cp")
        return self._all_reduce(value, dims).item() / (self.layout.dp * self.layout.cp)

    def _over_ranks(self, table: torch.Tensor) -> torch.Tensor:
        """Summed over the ranks of other sequences (dp), other chunks of them (cp), and stages (pp:
        the last holds the loss); tp ranks hold the same."""
        return self._all_reduce(table, ("pp", "dp_replicate", "dp_shard", "cp"))

    def update_balance(self, per_layer: bool = False) -> dict[str, Any]:
        """Token counts summed over the data-parallel ranks (tp ranks see the same tokens), metrics over
        stages: every stage of a MoE model joins, with or without MoE layers of its own."""
        if not self.moe_model:
            return {}
        # cp ranks route different chunks of the sequences
        over_data = functools.partial(self._all_reduce, dims=("dp_replicate", "dp_shard", "cp"))
        over_stages = functools.partial(self._all_reduce, dims=("pp",))
        table = self.moe_shape if per_layer else None
        return balance_step(self.moe, over_data, over_stages, self.device, table)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global L2 norm over every shard of every stage; scale gradients down to max_norm.

        Each rank adds the squared norms of its local shards, weighted by 1 / (number of ranks of its
        stage holding that same shard), and one sum over the mesh gives every rank the total: no
        gathering of gradients, and a replicated gradient is counted once."""
        params = [p for part in self.parts for p in part.parameters() if p.grad is not None]
        counted = [p for p in params if id(p) not in self.norm_skips]  # a tied copy: the embedding's
        for p in params:  # e.g. norm weights under sequence parallelism: sum the partial gradients once
            if isinstance(p.grad, DTensor) and any(q.is_partial() for q in p.grad.placements):
                placements = [Replicate() if q.is_partial() else q for q in p.grad.placements]
                p.grad = p.grad.redistribute(p.grad.device_mesh, placements)
        grads = [p.grad for p in params]
        shards = [local(p.grad) for p in counted]
        holders = self.layout.dp * self.layout.cp * self.layout.tp  # ranks of one stage
        weights = [_distinct_shards(p.grad) / holders for p in counted]
        norms = foreach_norm(shards) if shards else []
        squared = sum((n.double() ** 2 * w for n, w in zip(norms, weights)), torch.zeros((), dtype=torch.float64))
        total = math.sqrt(self._all_reduce(squared.reshape(1).to(self.device), self.mesh.mesh_dim_names).item())
        if max_norm > 0 and total > max_norm:
            foreach_mul_(grads, max_norm / (total + 1e-6))
        return total


def _distinct_shards(t: torch.Tensor) -> int:
    """How many different pieces the ranks of its mesh hold of a DTensor (1 for a plain tensor)."""
    if not isinstance(t, DTensor):
        return 1
    # Shard, or FSDP's _StridedShard over a tensor-parallel Shard: anything but Replicate/Partial
    return math.prod(
        t.device_mesh.size(i) for i, p in enumerate(t.placements) if not (p.is_replicate() or p.is_partial())
    )


class ParallelRunner(DistributedRunner):
    """Tensor and/or data parallel, no pipeline: micro-batch accumulation (FSDP reduce-scatters every
    micro-batch; DDP, and HSDP across its replicas, all-reduce on the last: parallel/data.py)."""

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        chunks = self.microbatches(inputs, targets)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        with loss_context(self.layout.tp):
            for i, (x, y) in enumerate(chunks):
                set_gradient_sync(self.model, self.layout, i == len(chunks) - 1)
                loss = self._loss(x, y) / len(chunks)
                loss.backward()
                total += local(loss).detach()
        return self._global_mean(total)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        with loss_context(self.layout.tp):
            losses = [_scalar(self._loss(x, y)) for x, y in self.microbatches(inputs, targets)]
        return self._global_mean(sum(losses) / len(losses))


class PipelineRunner(DistributedRunner):
    """A pipeline schedule over this rank's stages (tensor and data parallel inside each stage)."""

    def __init__(self, parts: list[nn.Module], stages: list[int], layout: Layout, **kw: Any) -> None:
        super().__init__(parts, layout.micro, layout=layout, **kw)
        n_stages = layout.stages
        self.first, self.last = 0 in stages, n_stages - 1 in stages
        tp_mesh = self.mesh["tp"]

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            if self.layout.tp > 1:  # the stage sends and returns local tensors: re-wrap the vocab shards
                logits = DTensor.from_local(logits, tp_mesh, [Shard(-1)], run_check=False)
            loss = cross_entropy(logits, targets)
            return local(loss)

        self.schedule = build_schedule(
            parts,
            stages,
            n_stages,
            self.mesh.get_group("pp"),
            self.device,
            layout.schedule,
            layout.microbatches,  # the rank's batch (micro x microbatches) splits into these
            loss_fn,
        )
        self.tied = tied_copies(parts)  # tied embeddings: the first stage's and the last's copy
        self.tie_group = tie_group(layout, self.mesh) if parts[0].cfg.tied_embeddings else None
        self.norm_skips = output_copies(parts)

    def _run(self, run: Any, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        losses: list[torch.Tensor] = []
        # torch 2.11 checks each microbatch's strides against those of its shape inference (contiguous),
        # and a loader's inputs are a slice of seq + 1 tokens
        args = (inputs.contiguous(),) if self.first else ()
        kwargs = {"target": targets, "losses": losses} if self.last else {}
        if self.document_eos is not None:  # later stages see no tokens: every stage gets the document ids
            kwargs["documents"] = self.documents(inputs)
        kept = token_losses() if recording() else contextlib.nullcontext([])
        with loss_context(self.layout.tp), self._autocast(), kept as recorded:
            run(*args, **kwargs)
        # the schedule's shape inference (first step, and after a switch from eval) runs the loss once
        # more, on placeholders: the data's per-token losses are the last microbatches' (loss.token_losses)
        for per_token in recorded[-self.layout.microbatches :]:
            record(per_token)
        local = sum(loss.item() for loss in losses) / len(losses) if self.last else 0.0
        return self._global_mean(local, self.last)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        calls: list[list[list[torch.Tensor]]] = [[] for _ in self.parts]
        hooks = [  # each forward of each MoE stage: the MoE counters before it
            part.register_forward_pre_hook(lambda *_, i=i: calls[i].append(moe_counters(self.stage_moe[i])))
            for i, part in enumerate(self.parts)
            if self.stage_moe[i]
        ]
        try:
            loss = self._run(lambda *a, **k: self.schedule.step(*a, return_outputs=False, **k), inputs, targets)
        finally:
            for hook in hooks:
                hook.remove()
        # the schedule infers shapes with one extra forward per stage on placeholder inputs (at the
        # first step, and after each switch from eval): its routing counts are not the data's
        for layers, seen in zip(self.stage_moe, calls):
            if len(seen) > self.layout.microbatches:
                discount(layers, seen[0], seen[1])
        sum_tied_grads(self.tied, self.tie_group)  # once per step, before clipping (parallel/tied.py)
        return loss

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        # the V schedules evaluate on their forwards alone (torch's eval runs their backward hand-offs)
        with forward_only(self.schedule) if self.layout.v_shape else contextlib.nullcontext():
            return self._run(self.schedule.eval, inputs, targets)
