"""Every private PyTorch API the project uses, in one place (Hydra's and submitit's: compat/hydra_compat.py;
DCP's reading side: compat/dcp_compat.py; pipelining's: compat/pipeline_compat.py; the compiler's:
compat/compile_compat.py).

Each is used here for a reason (no public API does the same) and has a test in tests/unit/test_compat.py
that checks the signature or behaviour the project relies on, so an upgrade that changes one fails
there, loudly, rather than somewhere in a run. torch is imported only when a torch API is used:
`plan` and the SLURM submission side import this module without it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from launcher.errors import CROSSING, LauncherError

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed import Store
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure


# --- PyTorch ------------------------------------------------------------------------------------------
def leave_process_groups() -> None:
    """`destroy_process_group`, then free the groups now, while Python still runs. Every DeviceMesh
    holds its groups (`_pg_registry`), and DTensor's caches hold meshes, so the groups outlived
    `destroy_process_group` into interpreter shutdown, where a group's worker thread that still had to
    drop a finished collective's tensors could not take the GIL and aborted the process ('terminate
    called without an active exception': the end of 1 in ~15 SLURM jobs on a loaded machine). Emptying
    the meshes' registries frees the groups, and freeing a group joins its threads."""
    import gc
    import sys

    import torch.distributed as dist

    dist.destroy_process_group()
    if "torch.distributed.device_mesh" in sys.modules:
        from torch.distributed.device_mesh import DeviceMesh

        for obj in gc.get_objects():
            # by type: isinstance runs some objects' metaclass checks, which warn on deprecated ones
            if issubclass(type(obj), DeviceMesh):
                obj._pg_registry.clear()
    gc.collect()


def replicate(module: nn.Module, mesh: DeviceMesh) -> None:
    """DDP as a composable API on the FSDP2 machinery (gradients all-reduced over `mesh`), in place.
    No public API does it: DistributedDataParallel wraps the module (its parameter names change) and
    does not compose with `fully_shard` for HSDP-like meshes."""
    from torch.distributed._composable.replicate_with_fsdp import replicate as replicate_with_fsdp

    replicate_with_fsdp(module, mesh=mesh)


def flatten_mesh(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """One mesh dimension `name` made of the adjacent dimensions `dims` (FSDP over dp_shard x cp, as
    torchtitan does); `sub_mesh` finds it later. DeviceMesh has no public flatten."""
    return mesh[dims]._flatten(name)


def sub_mesh(mesh: DeviceMesh, *dims: str) -> DeviceMesh:
    """`mesh[dims]`, where a dim may be a flattened one: torch warns since 2.11 that slicing those from
    the root mesh will be deprecated, but it is the way to get a 2-D (replicate, flattened shard)
    mesh for HSDP; tests/unit/test_compat.py checks it still works."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh[dims if len(dims) > 1 else dims[0]]


def enable_async_tp(group_name: str) -> None:
    """torch's async tensor parallelism over the TP group `group_name`: inductor's micro-pipeline pass
    splits each TP all-gather / reduce-scatter around its matmul into chunks that overlap (symmetric
    memory over NVLink). A private inductor flag, as torchtitan sets it. torch 2.13 deprecates
    `enable_symm_mem_for_group` ("no longer needed"), yet its pass still skips a group that has not
    called it: called where torch has it, its deprecation warning silenced."""
    import warnings

    import torch._inductor.config as inductor_config
    from torch.distributed import _symmetric_memory as symm_mem

    inductor_config._micro_pipeline_tp = True
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(group_name)


def bound_device(device: torch.device | None) -> dict[str, Any]:
    """`init_process_group`'s `device_id=device` where torch takes it: NCCL then creates the communicator
    at once on that GPU (no guess at the first collective), splits subgroups from it, and `barrier()`
    uses it. {} without a device or on a torch without the parameter."""
    import inspect

    import torch.distributed as dist

    if device is None or "device_id" not in inspect.signature(dist.init_process_group).parameters:
        return {}
    return {"device_id": device}


def all_gather_single(out: torch.Tensor, x: torch.Tensor, group: Any) -> None:
    """`x` of every rank of `group`, in rank order, into `out` along dim 0. torch 2.13 names it
    `all_gather_single` and deprecates `all_gather_into_tensor`, the only name 2.11 has."""
    import torch.distributed as dist

    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, x, group=group)


def reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, group: Any) -> None:
    """The sum of `x` over `group`, scattered into each rank's `out` along dim 0; named as `all_gather_single`."""
    import torch.distributed as dist

    getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, x, group=group)


def fake_store() -> Store:
    """The store of the "fake" process-group backend: every collective returns at once, with no peer.
    torch ships it under torch.testing only."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def local_shard_extent(
    shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The local shape of a DTensor of global `shape` at mesh `coordinate`, and its offset in the
    global tensor, by DTensor's own rule (uneven splits, FSDP's strided shards), without building it."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate), list(placements))
    return tuple(local), tuple(offset)


def foreach_norm(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norm of each tensor in one fused kernel (what clip_grad_norm_ uses)."""
    import torch

    return list(torch._foreach_norm(tensors))


def foreach_mul_(tensors: list[torch.Tensor], scale: float) -> None:
    """Multiply each tensor by `scale` in place, in one fused kernel."""
    import torch

    torch._foreach_mul_(tensors, scale)


def all_to_all_autograd(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any) -> torch.Tensor:
    """`all_to_all_single` whose backward runs the reverse exchange (expert parallelism's dispatch and
    combine). torch.distributed.nn.functional's version is deprecated in favour of this one, which
    has no public name yet."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x, output_splits, input_splits, group))


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of x (M, K) in groups ending at `offsets` (int32), group g times w[g] (G, K, N): one
    kernel for every expert (the MoE grouped GEMM). No public name yet; autograd-aware."""
    import torch

    return torch._grouped_mm(x, w, offs=offsets)


def grouped_mm_kernel(device: torch.device) -> bool:
    """Whether `grouped_mm` has its fast bf16 (CUTLASS) kernel on `device`: CUDA compute capability 9.x
    or 10.x (H100/H200, B200). Elsewhere it runs too (CPU included), as a loop of matmuls inside the
    op (on CUDA after copying the offsets to the host): no gain."""
    import torch

    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(device)[0] in (9, 10)


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread: a forward run inside
    one is activation recompute (MoE token counts must not count it twice)."""
    import torch

    return torch._C._current_graph_task_id() != -1


def attention_ops() -> set[Any]:
    """The attention kernels `scaled_dot_product_attention` dispatches to (CPU, flash, efficient,
    cuDNN), under their private names."""
    import torch

    aten = torch.ops.aten
    return {
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
    }


def flex_attention_ops() -> set[Any]:
    """FlexAttention's higher-order op (`torch.ops.higher_order.flex_attention`), where torch has it: the
    kernel of document masks on CUDA (launcher/model/documents.py). A checkpoint's policy sees flex as that
    one op, not the aten ops inside it (torch registers it with selective checkpointing's dispatch modes), so
    a policy that keeps attention must name it beside SDPA's kernels, or backward reruns the masked attention."""
    import torch

    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    return set() if flex is None else {flex}


def attention_and_collective_ops() -> set[Any]:
    """The non-matmul ops selective recompute keeps the outputs of: SDPA's attention kernels, and the
    functional all-reduce / reduce-scatter that finish a row-parallel matmul under tensor (and
    sequence) parallelism, so that recomputation never repeats a collective (and flex's op:
    `flex_attention_ops`, a higher-order op rather than an aten one)."""
    import torch

    c10d = torch.ops._c10d_functional
    return attention_ops() | {c10d.all_reduce.default, c10d.reduce_scatter_tensor.default}


def compiled_recompute_keeps_attention() -> bool:
    """Whether a compiled block recomputed in full must keep attention's output: torch 2.13's compiled
    checkpoint of a tensor-parallel block whose backward re-runs SDPA saves the DeviceMesh among its
    tensors and fails in the first forward ("expected all tensors_saved_with_vc_check to be Tensors");
    2.11 and 2.15 compile the same block (tests/unit/test_compile.py under `make test-compat`)."""
    import torch

    return torch.__version__.startswith("2.13.")


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors behind `t`, whose storages hold its bytes: a tensor subclass's inner tensors
    (a DTensor's local shard, an AsyncCollectiveTensor's result), recursively; else `t` itself."""
    import torch
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return [t]
    inner = (getattr(t, name) for name in t.__tensor_flatten__()[0])
    return [x for i in inner if isinstance(i, torch.Tensor) for x in inner_tensors(i)]


def failure_line(failure: ProcessFailure) -> str:
    """One line from the elastic agent's record of a failed worker: the exception (`Type: message`)
    from its error file, or the signal that ended it."""
    message = failure.message
    if isinstance(message, dict):  # a Python exception, recorded with its traceback
        message = message.get("message", "")
    text = str(message).strip()
    return text.splitlines()[-1] if text else "no error message (see its log)"


def flight_recorder_trace() -> bytes:
    """The flight recorder's record of this process's collectives (the pickle torch writes when a NCCL
    collective times out), taken now: `_dump_fr_trace` (torch 2.13 has it), else the older name `_dump_nccl_trace`."""
    from torch._C import _distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace", None) or c10d._dump_nccl_trace
    return dump()


def record_cuda_memory_history(enabled: bool) -> None:
    """Start (or stop) recording every CUDA allocation with its stack, for `dump_cuda_memory_snapshot`.
    torch documents these as the memory-snapshot API but keeps them underscored (torch.cuda.memory)."""
    import torch

    torch.cuda.memory._record_memory_history("all" if enabled else None, max_entries=100_000)


def dump_cuda_memory_snapshot(path: str) -> None:
    """Write the recorded history as a pickle that pytorch.org/memory_viz renders."""
    import torch

    torch.cuda.memory._dump_snapshot(path)


def quiet_agent_logs() -> None:
    """Drop three of the agent's log records: its warning that, off the main thread, it cannot install its
    signal handlers (here that is the point), its traceback of a worker that stopped on bad input or a
    non-finite loss (errors.CROSSING), which the CLI reports in one line, and its note that it terminates the
    other workers after one failed (when every rank raises at the same step, a slower one is still on its way
    out). A dead worker's record loses the agent's own traceback. The loggers' names and messages are torch's."""
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(expected_records)
    logging.getLogger("torch.multiprocessing.spawn").addFilter(expected_records)


def expected_records(record: logging.LogRecord) -> bool:
    message = record.getMessage() + (str(record.exc_info[1]) if record.exc_info else "")
    ours = any(f"{LauncherError.__module__}.{name}:" in message for name in CROSSING)
    noise = ("running on a child thread", "via signal SIGTERM")
    if record.exc_info and type(record.exc_info[1]).__name__ == "ProcessExitedException":
        record.exc_info = record.exc_text = None
    return not ours and not any(text in message for text in noise)


def stop_forkserver() -> None:
    """multiprocessing's forkserver stopped, if one runs (private: `ForkServer._stop`, CPython's own tests
    use it): the next process it is asked for starts a new one, with this process's environment then."""
    from multiprocessing import forkserver

    forkserver._forkserver._stop()
