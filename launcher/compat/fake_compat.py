"""The fake-tensor machinery of the simulation (launcher/simulate/): torch's private `FakeTensorMode` and
`MemTracker` (torch._subclasses, torch.distributed._tools), and what the runtime needs around them.

- `StepTracker`: torch's tracker refuses a root module called twice between resets; gradient
  accumulation and pipeline microbatches do exactly that, so a repeat call starts the module's stats again
  (the categories and the peak, which are all we read, are kept). It keeps the global peak only. A host read
  (`.item()`: the loss, the gradient norm) of a fake tensor has no value: under the tracker it reads 1 (which
  clips nothing); one mode does both, as each mode stacked costs every op a Python dispatch.
- `propagation_unseen`: DTensor's sharding propagation allocates nothing real; the tracker does not count it.
- `forget_meshes`: no cached DTensor decision outlives a position's process group.
- `forward_hooks`: the tracker's hooks of a microbatch's forward, removed after its backward (they would hold
  its graph, and a pipeline stage's received input, to the end of the step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

SCALAR = torch.ops.aten._local_scalar_dense.default  # a host read: `.item()`
TOTAL = "Total"  # MemTracker's key of a snapshot's sum
# MemTracker's categories (`_MemRefType` values) → the names printed and written
CATEGORIES = {
    "Parameter": "params",
    "Gradient": "grads",
    "Optstate": "optimizer",
    "Buffer": "buffers",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "other",
}


def fake_mode() -> FakeTensorMode:
    """A fake mode that takes the meta parameters `materialize` replaces (real inputs are refused after the
    build: `strict`)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def strict(mode: FakeTensorMode) -> None:
    """From here on a real tensor meeting a fake one is an error, not a silent conversion."""
    mode.allow_non_fake_inputs = False


@contextlib.contextmanager
def propagation_unseen(tracker: StepTracker) -> Iterator[None]:
    """DTensor infers an op's output shapes by running it on fake tensors of the global shapes, in the fake mode
    it finds active: ours, so the tracker would count them (a fused AdamW step over every parameter: the whole
    model's state at once, 34 x the shards at tp=8). The propagation runs under `ShardingPropagator._fake_mode_lock`
    (torch's hook for a lock); ours marks the tracker blind for its duration."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    class Mark:
        def __enter__(self) -> None:
            tracker.propagating = True

        def __exit__(self, *_: object) -> None:
            tracker.propagating = False

    kept = ShardingPropagator._fake_mode_lock
    ShardingPropagator._fake_mode_lock = Mark()
    try:
        yield
    finally:
        ShardingPropagator._fake_mode_lock = kept


def forget_meshes() -> None:
    """Drop DTensor's sharding-propagation caches. They key on a mesh's shape, not on its process groups: the next
    pipeline position's rank (a new fake group, new group names) would be handed the last one's mesh and reach
    for its destroyed groups (seen under sequence parallelism)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


@contextlib.contextmanager
def forward_hooks() -> Iterator[list[Any]]:
    """The handles of the backward hooks torch's tracker registers on module inputs during a forward, to remove
    after that forward's backward. Each is a multi-grad hook whose closure holds the grad_fn of the very input it
    is registered on: a cycle through autograd's C++ nodes that Python's collector cannot see. Left in place,
    every microbatch's graph stays alive to the leaves, and a pipeline stage's received input (a leaf) and its
    gradient stay counted to the step's end (+2 hidden states per microbatch the real, untracked run frees)."""
    import torch.distributed._tools.mod_tracker as mod_tracker

    handles: list[Any] = []
    register = mod_tracker.register_multi_grad_hook

    def kept(*args: Any, **kwargs: Any) -> Any:
        handles.append(register(*args, **kwargs))
        return handles[-1]

    mod_tracker.register_multi_grad_hook = kept
    try:
        yield handles
    finally:
        mod_tracker.register_multi_grad_hook = register


class StepTracker(MemTracker):
    """torch's MemTracker, for modules called once per microbatch (see the module docstring), blind to
    DTensor's sharding propagation (`propagation_unseen`); `.item()` reads 1 (see the module docstring)."""

    propagating = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is SCALAR:
            return 1.0 if args[0].is_floating_point() else 1
        if self.propagating:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        name = self._mod_tracker.get_known_fqn(module)
        repeat = module in self.memory_tracking and not self._mod_tracker.is_bw
        if repeat and set(self._mod_tracker.parents) - {name} == {"Global"}:
            del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state: Any) -> None:
        # the global peak only: torch's also walks every module's stats at every op (half the run's time)
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap[TOTAL]:
                self._peak_mem[dev] = snap[TOTAL]
                self._peak_mem_snap[dev] = dict(snap)

    def peak(self) -> dict[str, int]:
        """Bytes per category at the peak (of every device: the simulation has one), and `total`."""
        out = dict.fromkeys(CATEGORIES.values(), 0)
        out["total"] = 0
        for snap in self.get_tracker_snapshot("peak").values():
            for key, nbytes in snap.items():
                name = CATEGORIES.get(getattr(key, "value", ""), "total" if key == TOTAL else "other")
                out[name] += nbytes
        return out
