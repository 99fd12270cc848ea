"""Each private PyTorch API in launcher/compat/torch_compat.py and launcher/compat/dcp_compat.py still has the
signature and the behaviour the project relies on: these fail loudly on an upgrade that changes one, naming
the API to port."""

from __future__ import annotations

import inspect
import io
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from launcher.compat import pipeline_compat
from launcher.compat import torch_compat as compat
from launcher.compat.dcp_compat import TORCH_SAVE_MAGIC, SafeFileSystemReader, dcp_storage_items
from launcher.model.init import initialized_model
from launcher.train.checkpoint import Checkpointer, Stateful
from launcher.train.optim import build_optimizer
from launcher.train.untrusted import load_dcp_metadata
from tests.conftest import symm_mem_needs_enabling, tiny_config


# --- PyTorch ------------------------------------------------------------------------------------------
def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _groups_left_running(rank: int, world: int) -> tuple[int, int]:
    """Threads of this process while a tensor-parallel mesh has run a DTensor op, and after leaving."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    x = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    (x @ x.T).redistribute(mesh, [Replicate()])
    del mesh, x
    running = _threads()
    compat.leave_process_groups()
    return running, _threads()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_leaving_joins_every_groups_worker_threads() -> None:
    """The gloo groups a DTensor op used are freed, their worker threads joined, before Python exits
    (DTensor's caches kept them alive into interpreter shutdown, where a worker could abort the process)."""
    from tests.dist import run

    for running, left in run(_groups_left_running, 2):
        assert left <= running - 2, (running, left)  # at least the default group's two workers


def test_replicate_takes_a_mesh() -> None:
    """DDP on the FSDP2 machinery; tests/integration/test_parallel.py checks what it computes."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    params = inspect.signature(replicate).parameters
    assert list(params)[0] == "module" and params["mesh"].kind is inspect.Parameter.KEYWORD_ONLY


def test_flatten_mesh_names_a_dimension_of_adjacent_ones() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from launcher.compat.torch_compat import fake_store, flatten_mesh, sub_mesh

    dist.init_process_group("fake", store=fake_store(), rank=5, world_size=8)
    try:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
        flat = flatten_mesh(mesh, ("b", "c"), "bc")
        assert flat.size() == 4
        assert sub_mesh(mesh, "bc").mesh.tolist() == [4, 5, 6, 7]  # rank 5's group: the a=1 slice, b and c row-major
        assert sub_mesh(mesh, "a", "bc").mesh.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]  # HSDP: (replicate, shard)
    finally:
        dist.destroy_process_group()


def test_cuda_memory_snapshot_api() -> None:
    """profile.memory (launcher/metrics/profile.py): record the allocator's history, dump it (CUDA only;
    the signatures are checked here, the dump by bench/gpu_check.py on a GPU)."""
    record = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    assert list(record)[0] == "enabled" and "max_entries" in record
    assert list(inspect.signature(torch.cuda.memory._dump_snapshot).parameters)[0] == "filename"


def test_gather_and_scatter_run_under_their_names_of_this_torch() -> None:
    """torch 2.11 has no `all_gather_single` (cp=2 failed there), 2.13 deprecates the older names: no warning."""
    import warnings

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        out, back = torch.empty(2, 3), torch.empty(2, 3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compat.all_gather_single(out, torch.ones(2, 3), None)
            compat.reduce_scatter_single(back, out * 2, None)
        assert torch.equal(back, torch.full((2, 3), 2.0))
    finally:
        dist.destroy_process_group()


def test_fake_store_runs_collectives_without_peers() -> None:
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=compat.fake_store(), rank=3, world_size=8)
    try:
        t = torch.ones(2)
        dist.all_reduce(t)  # returns at once: 7 peers that do not exist
        assert dist.get_rank() == 3 and dist.get_world_size() == 8
    finally:
        dist.destroy_process_group()


def test_inner_tensors_of_a_dtensor_is_its_local_shard() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    plain = torch.ones(2)
    assert compat.inner_tensors(plain) == [plain]
    dist.init_process_group("fake", store=compat.fake_store(), rank=1, world_size=2)
    try:
        d = distribute_tensor(torch.arange(8.0).reshape(4, 2), init_device_mesh("cpu", (2,)), [Shard(0)])
        (local,) = compat.inner_tensors(d)
        assert type(local) is torch.Tensor and local.shape == (2, 2)
        assert local.untyped_storage().data_ptr() == d.to_local().untyped_storage().data_ptr()
    finally:
        dist.destroy_process_group()


def test_local_shard_extent_follows_dtensor_chunking() -> None:
    from torch.distributed.tensor import Replicate, Shard

    # torch.chunk: 10 rows over 4 ranks -> 3, 3, 3, 1 at rows 0, 3, 6, 9
    extents = [compat.local_shard_extent((10, 4), (4,), (c,), [Shard(0)]) for c in range(4)]
    assert extents == [((3, 4), (0, 0)), ((3, 4), (3, 0)), ((3, 4), (6, 0)), ((1, 4), (9, 0))]
    assert compat.local_shard_extent((8, 6), (2, 2), (1, 1), [Shard(0), Shard(1)]) == ((4, 3), (4, 3))
    assert compat.local_shard_extent((8, 6), (2, 2), (1, 0), [Replicate(), Shard(1)]) == ((8, 3), (0, 0))


def test_schedule_actions_reads_torchs_pipeline_order() -> None:
    from torch.distributed.pipelining import ScheduleDualPipeV, ScheduleInterleaved1F1B

    orders = pipeline_compat.schedule_actions(ScheduleInterleaved1F1B, 2, [[0, 2], [1, 3]], 2)
    assert orders[0][:4] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 2), ("F", 1, 2)]
    assert sorted(orders[1]) == sorted([(k, mb, s) for k in "FB" for mb in (0, 1) for s in (1, 3)])
    dual = pipeline_compat.schedule_actions(ScheduleDualPipeV, 2, [[0, 3], [1, 2]], 4)  # overlapped pairs unfolded
    for r, stages in enumerate([[0, 3], [1, 2]]):
        for s in stages:
            for mb in range(4):
                done = [k for k, m, st in dual[r] if (m, st) == (mb, s)]
                assert done in (["F", "B"], ["F", "I", "W"]), (r, s, mb, done)


def test_pipeline_stage_opens_no_link_to_its_own_rank() -> None:
    """Rank 1 of a V placement over 2 ranks holds stages 1 and 2: their links to each other stay on the
    rank (torch 2.11 sent there, which gloo refuses), those to stages 0 and 3 go to rank 0."""
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, schedules

    if not hasattr(PipelineStage, "_get_init_p2p_neighbors_ops"):  # later torch opens the links otherwise
        assert "_get_init_p2p_neighbors_ops" not in inspect.getsource(schedules)
        return
    dist.init_process_group("fake", store=compat.fake_store(), rank=1, world_size=2)
    try:
        stages = [pipeline_compat.pipeline_stage(nn.Identity(), s, 4, torch.device("cpu"), None) for s in (1, 2)]
        for stage in stages:
            stage.stage_index_to_group_rank = {0: 0, 1: 1, 2: 1, 3: 0}  # what a V schedule sets
        assert [op.group_peer for stage in stages for op in stage._get_init_p2p_neighbors_ops()] == [0] * 4
    finally:
        dist.destroy_process_group()


def test_foreach_norm_and_mul() -> None:
    tensors = [torch.tensor([3.0, 4.0]), torch.ones(4)]
    assert [n.item() for n in compat.foreach_norm(tensors)] == [5.0, 2.0]
    compat.foreach_mul_(tensors, 0.5)
    assert tensors[0].tolist() == [1.5, 2.0]


def test_sdpa_on_cpu_dispatches_to_an_op_selective_recompute_saves() -> None:
    """Otherwise selective recompute would silently recompute attention (and save nothing)."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    ops = compat.attention_and_collective_ops()
    assert all(isinstance(op, torch._ops.OpOverload) for op in ops) and len(ops) == 6
    seen = set()

    def record(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        seen.add(op)
        return CheckpointPolicy.PREFER_RECOMPUTE

    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    out = checkpoint(
        lambda x: F.scaled_dot_product_attention(x, x, x, is_causal=True),
        q,
        use_reentrant=False,
        context_fn=lambda: create_selective_checkpoint_contexts(record),
    )
    out.sum().backward()
    assert seen & ops, f"attention ran as {sorted(map(str, seen))}"


def test_failure_line_reads_elastics_error_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, ProcessFailure

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise ValueError("boom")
    except ValueError as err:
        ErrorHandler().record_exception(err)  # what a worker writes when it dies of an exception
    crashed = ProcessFailure(local_rank=1, pid=123, exitcode=1, error_file=str(error_file))
    killed = ProcessFailure(local_rank=0, pid=5, exitcode=-9, error_file=str(tmp_path / "none.json"))
    assert compat.failure_line(crashed) == "ValueError: boom"
    assert compat.failure_line(killed) == "Signal 9 (SIGKILL) received by PID 5"
    assert crashed.timestamp > 0  # spawn.py takes the earliest failure


# --- distributed checkpoint -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real checkpoint of the tiny model and its AdamW state (tensors and non-tensor values)."""
    tmp = tmp_path_factory.mktemp("compat")
    cfg = tiny_config(tmp)
    model = initialized_model(cfg.model, cfg.seed, torch.device("cpu"))
    optimizer, _ = build_optimizer([model], cfg.optim, 4)
    model(torch.randint(0, 256, (1, 8))).sum().backward()
    optimizer.step()
    Checkpointer(cfg.checkpoint, tmp / "checkpoints", 0).save([model], optimizer, Stateful(1, {}))
    return tmp / "checkpoints" / "step_00000001"


def test_restricted_unpickler_reads_what_the_full_one_reads(checkpoint: Path) -> None:
    raw = (checkpoint / ".metadata").read_bytes()
    restricted = load_dcp_metadata(io.BytesIO(raw))  # an unlisted class here: torch changed the format
    assert restricted == pickle.loads(raw)
    assert any(key.startswith("model.") for key in restricted.state_dict_metadata)
    assert SafeFileSystemReader(str(checkpoint), load_dcp_metadata).read_metadata().storage_meta is not None


def test_restricted_unpickler_refuses_other_objects() -> None:
    class Call:
        def __reduce__(self):
            return (print, ("ran",))

    with pytest.raises(pickle.UnpicklingError, match=r"unexpected object builtins.print in .metadata"):
        load_dcp_metadata(io.BytesIO(pickle.dumps(Call())))
    with pytest.raises(pickle.UnpicklingError, match=r"unexpected object dict in .metadata"):
        load_dcp_metadata(io.BytesIO(pickle.dumps({"a": 1})))


def test_every_storage_item_is_a_torch_save_record_inside_its_file(checkpoint: Path) -> None:
    items = dcp_storage_items(SafeFileSystemReader(str(checkpoint), load_dcp_metadata).read_metadata())
    assert items
    for name, spans in items.items():
        data = (checkpoint / name).read_bytes()
        assert all(off + length <= len(data) and data[off : off + 4] == TORCH_SAVE_MAGIC for off, length in spans)


# --- PyTorch, continued -----------------------------------------------------------------------------
def test_enable_async_tp_arms_inductors_micro_pipeline_pass_for_the_group(monkeypatch) -> None:
    """The flag, and the group check torch 2.13's pass makes before fusing a collective
    (torch/_inductor/fx_passes/micro_pipeline_tp.py: `is_symm_mem_enabled_for_group`): True for the
    group enabled (rank 3 of a fake world of 8, 2-rank TP groups), for no other. A torch without
    `enable_symm_mem_for_group` (it is deprecated in 2.13) still gets the flag. From torch 2.15 the check
    no longer reads what enabling registers (a group is enabled wherever a symmetric-memory allocator
    exists: CUDA), so there the flag is all there is to set."""
    import torch._inductor.config as inductor_config
    from torch.distributed import _symmetric_memory as symm_mem
    from torch.distributed.device_mesh import init_device_mesh

    monkeypatch.setattr(symm_mem, "_group_name_to_store", {})  # the registry the check reads
    dist.init_process_group("fake", store=compat.fake_store(), rank=3, world_size=8)
    try:
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
        tp, dp = (mesh[dim].get_group().group_name for dim in ("tp", "dp"))
        with inductor_config.patch(_micro_pipeline_tp=False):  # pytest's monkeypatch would delete it on undo
            assert not symm_mem.is_symm_mem_enabled_for_group(tp)
            compat.enable_async_tp(tp)
            assert inductor_config._micro_pipeline_tp is True
            if symm_mem_needs_enabling():
                assert symm_mem.is_symm_mem_enabled_for_group(tp)
                assert not symm_mem.is_symm_mem_enabled_for_group(dp)
        monkeypatch.delattr(symm_mem, "enable_symm_mem_for_group")
        with inductor_config.patch(_micro_pipeline_tp=False):
            compat.enable_async_tp(dp)
            assert inductor_config._micro_pipeline_tp is True
    finally:
        dist.destroy_process_group()


def test_bound_device_where_init_process_group_takes_one(monkeypatch) -> None:
    """`device_id=` for NCCL's eager, GPU-bound init where torch has the parameter (2.3+); nothing
    without a device, or on a torch whose init_process_group lacks it."""
    gpu = torch.device("cuda", 3)
    assert compat.bound_device(gpu) == {"device_id": gpu}
    assert compat.bound_device(None) == {}
    monkeypatch.setattr(dist, "init_process_group", lambda backend=None, init_method=None, **kwargs: None)
    assert compat.bound_device(gpu) == {}


def test_grouped_mm_multiplies_each_row_group_by_its_matrix() -> None:
    """torch._grouped_mm's (2-D x 3-D, int32 group ends) form, which runs on CPU as well; its fast
    kernel is only on CUDA sm90 and sm100."""
    x, w = torch.randn(10, 8), torch.randn(3, 8, 16)
    out = compat.grouped_mm(x, w, torch.tensor([2, 2, 10], dtype=torch.int32))
    torch.testing.assert_close(out, torch.cat([x[:2] @ w[0], x[2:] @ w[2]]))
    assert not compat.grouped_mm_kernel(torch.device("cpu"))


@pytest.mark.parametrize(("capability", "fast"), [((9, 0), True), ((10, 0), True), ((8, 0), False), ((12, 0), False)])
def test_grouped_mm_fast_kernel_by_compute_capability(monkeypatch, capability: tuple[int, int], fast: bool) -> None:
    """H100/H200 (9.0) and B200 (10.0) have the CUTLASS kernel; A100 (8.0) and sm120 loop inside the op."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert compat.grouped_mm_kernel(torch.device("cuda", 0)) == fast


def test_in_backward_is_true_only_inside_autograd() -> None:
    in_backward = compat.in_backward
    seen: list[bool] = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(in_backward()) or g)
    assert not in_backward()
    y.sum().backward()
    assert seen == [True]


def test_agent_records_keep_their_line_and_lose_what_is_not_news() -> None:
    """The elastic agent's record of a worker killed by a signal keeps its line without the agent's own
    traceback (torch's ProcessExitedException); a worker's bad input (errors.CROSSING) is the CLI's to report."""
    import logging

    from torch.multiprocessing.spawn import ProcessExitedException

    def record(message: str, exc: BaseException | None) -> logging.LogRecord:
        info = (type(exc), exc, None) if exc is not None else None
        return logging.LogRecord(
            "torch.distributed.elastic.multiprocessing.api", logging.ERROR, "", 0, message, (), info
        )

    killed = record(
        "failed (exitcode: -9) local_rank: 0", ProcessExitedException("signal", 0, 5, -9, signal_name="SIGKILL")
    )
    assert compat.expected_records(killed) and killed.exc_info is None
    assert logging.Formatter().format(killed) == "failed (exitcode: -9) local_rank: 0"
    raised = record("failed (exitcode: 1)", RuntimeError("launcher.errors.LauncherError: bad input"))
    assert not compat.expected_records(raised)


# --- Python -------------------------------------------------------------------------------------------
def test_a_stopped_forkserver_is_replaced_by_one_with_the_environment_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """What spawn.start_local_workers relies on: a running forkserver forks with the environment it was
    started with; once stopped, the next process comes from a new one that has this process's."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    def forked(name: str) -> str | None:
        with ProcessPoolExecutor(1, mp_context=get_context("forkserver")) as pool:
            return pool.submit(os.getenv, name).result()

    monkeypatch.setenv("LAUNCHER_TEST_FORKSERVER", "first")
    compat.stop_forkserver()
    assert forked("LAUNCHER_TEST_FORKSERVER") == "first"
    monkeypatch.setenv("LAUNCHER_TEST_FORKSERVER", "second")
    assert forked("LAUNCHER_TEST_FORKSERVER") == "first"  # the running server's environment
    compat.stop_forkserver()
    assert forked("LAUNCHER_TEST_FORKSERVER") == "second"
    compat.stop_forkserver()


def test_compile_counts_read_dynamos_graphs_and_breaks() -> None:
    from launcher.compat.compile_compat import compile_counts, reset_compile_counts

    def broken(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        torch._dynamo.graph_break()
        return y.cos()

    reset_compile_counts()
    torch.compile(broken, backend="aot_eager")(torch.randn(3, requires_grad=True)).sum().backward()
    graphs, breaks = compile_counts()
    assert graphs == 2 and sum(breaks.values()) == 1 and "graph_break()" in next(iter(breaks))
    reset_compile_counts()
    assert compile_counts() == (0, {})
