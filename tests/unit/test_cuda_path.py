"""The CUDA path's decisions, exercised on a CPU: precision (FSDP2 mixed precision vs autocast),
the optimizer's implementation, compile=auto, the CUDA environment defaults and the NCCL timeout.
The FSDP2 bf16 policy and fused AdamW also run for real here: FSDP2 and fused AdamW accept CPU
tensors, so a 2-process gloo run with the cuda profile's choices is compared with one process."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from launcher.config.hardware import HardwareConfig
from launcher.config.layout_keys import from_config
from launcher.config.model import ModelConfig
from launcher.config.precision import autocast_for, fsdp_policy, precision_mode
from launcher.config.schema import OptimConfig, TrainConfig, compile_enabled
from launcher.config.validate import validate
from launcher.errors import LauncherError
from launcher.launch.rank_env import CUDA_ENV, FLIGHT_RECORDER_FILE, cuda_env_defaults
from launcher.launch.spawn import run_rank
from launcher.layout import build_mesh
from launcher.parallel import build_runner
from launcher.planner import build_options
from launcher.train.optim import adamw_impl, build_optimizer, optimizer_impl
from launcher.train.setup import pick_device
from tests.conftest import run_for, symm_mem_needs_enabling
from tests.dist import run

CUDA = HardwareConfig(name="h100_sxm", kind="cuda", peak_tflops=989.0)
CPU = HardwareConfig(peak_tflops=1.0)  # a peak given: build_options calibrates none (make_cfg has no cache_dir)
STEPS, SEQ, BATCH = 4, 16, 8


def make_cfg(hardware: HardwareConfig = CPU, **keys: object) -> TrainConfig:
    model = ModelConfig(name="test", dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=64)
    optim = OptimConfig(lr=1e-2, warmup_steps=1)
    cfg = TrainConfig(model=model, optim=optim, hardware=hardware, steps=STEPS, seq_len=SEQ, seed=3)
    return replace(cfg, batch={"micro": 2, "global": BATCH}, **keys)


@pytest.mark.parametrize(
    ("hardware", "keys", "world", "mode"),
    [
        (CUDA, {}, 2, "fsdp_bf16"),  # FSDP on cuda: the policy, no autocast
        (CUDA, {"dp_replicate": 2, "dp_shard": 2}, 4, "fsdp_bf16"),  # HSDP too
        (CUDA, {"dp_shard": 1}, 2, "autocast_bf16"),  # DDP
        (CUDA, {"tp": 2}, 2, "autocast_bf16"),  # pure TP
        (CUDA, {}, 1, "autocast_bf16"),  # one process
        (CUDA, {"dtype": "fp32"}, 2, "fp32"),
        (CPU, {}, 2, "fp32"),  # cpu, auto: unchanged
        (CPU, {"dtype": "bf16"}, 2, "autocast_bf16"),  # cpu, bf16: autocast as before
    ],
)
def test_precision_follows_hardware_and_layout(hardware: HardwareConfig, keys: dict, world: int, mode: str) -> None:
    cfg = make_cfg(hardware, **keys)
    layout = from_config(cfg, world)
    assert precision_mode(cfg.dtype, hardware.kind, layout) == mode
    policy = fsdp_policy(mode)
    assert (policy is not None) == (mode == "fsdp_bf16")
    if policy is not None:
        assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    if hardware.kind == "cpu":  # a CUDA autocast cannot be built on this machine
        autocast = autocast_for(mode, torch.device("cpu"))
        assert (autocast is not None) == (mode == "autocast_bf16")


def test_fused_adamw_only_when_every_parameter_can_take_it() -> None:
    params = [torch.zeros(2), torch.zeros(3)]
    assert adamw_impl(params) == "fused"  # CPU tensors: torch has the fused kernel on CPU too
    assert adamw_impl([torch.zeros(2, device="meta")]) == "foreach"  # no fused kernel there
    assert adamw_impl(params, fusable=lambda p: True) == "fused"
    assert adamw_impl(params, fusable=lambda p: p.numel() == 2) == "foreach"  # torch refuses a mix
    optimizer, _ = build_optimizer([torch.nn.Linear(2, 2)], OptimConfig(), 10, fusable=lambda p: True)
    assert optimizer_impl(optimizer) == "fused"
    optimizer, _ = build_optimizer([torch.nn.Linear(2, 2)], OptimConfig(), 10)
    assert optimizer_impl(optimizer) == "fused"
    optimizer, _ = build_optimizer([torch.nn.Linear(2, 2)], OptimConfig(), 10, fusable=lambda p: False)
    assert optimizer_impl(optimizer) == "foreach"


@pytest.mark.parametrize(("hardware", "value", "on"), [(CPU, "auto", False), (CUDA, "auto", True)])
def test_compile_auto_follows_hardware(hardware: HardwareConfig, value: str, on: bool) -> None:
    assert compile_enabled(make_cfg(hardware, compile=value)) is on
    assert compile_enabled(make_cfg(hardware, compile=not on)) is (not on)  # an explicit value wins


def test_compile_refuses_other_values() -> None:
    with pytest.raises(LauncherError, match="compile=yes: choose one of true, false, auto"):
        validate(make_cfg(compile="yes"))


def test_cuda_env_defaults_only_on_cuda_and_never_override() -> None:
    """Each setting under all of its names (torch 2.13 reads TORCH_FR_BUFFER_SIZE, then its old name
    TORCH_NCCL_TRACE_BUFFER_SIZE; PYTORCH_ALLOC_CONF, then PYTORCH_CUDA_ALLOC_CONF); the flight recorder
    on, dumping on a timeout. A user's value under any name of a setting wins."""
    environ: dict[str, str] = {}
    cuda_env_defaults("cpu", environ)
    assert environ == {}
    cuda_env_defaults("cuda", environ)
    assert environ == {name: value for names, value in CUDA_ENV.items() for name in names}
    assert environ["PYTORCH_CUDA_ALLOC_CONF"] == environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    assert environ["TORCH_FR_BUFFER_SIZE"] == environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    mine = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "PYTORCH_ALLOC_CONF": "max_split_size_mb:128"}
    mine |= {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    environ = dict(mine)
    cuda_env_defaults("cuda", environ)
    assert environ == mine


def test_each_rank_computes_on_the_gpu_its_local_rank_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    """run_rank sets the device from the local rank (SLURM sets SLURM_LOCALID, not LOCAL_RANK)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    cfg = make_cfg(CUDA)
    options = build_options(cfg, from_config(cfg, 1))
    assert pick_device(options) == torch.device("cuda", 3)
    assert pick_device(replace(options, device="cpu")) == torch.device("cpu")


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(50 + step))
    return tokens[:, :-1], tokens[:, 1:]


def train_losses(rank: int, world_size: int, cfg: TrainConfig) -> dict[str, object]:
    """STEPS steps of `cfg` on this rank (world_size 1: the single-process reference)."""
    layout = from_config(cfg, world_size)
    device = torch.device("cpu")
    mesh = build_mesh(layout, "cpu") if world_size > 1 else None
    runner = build_runner(cfg.model, layout, mesh, build_options(cfg, layout), device)
    fused = cfg.hardware.kind == "cuda"  # what a cuda run picks, forced onto these CPU tensors
    optimizer, schedule = build_optimizer(runner.parts, cfg.optim, cfg.steps, fusable=lambda p: fused)
    local = BATCH // layout.dp
    dp_rank = layout.coordinates(rank)["dp"]
    losses = []
    for step in range(1, STEPS + 1):
        x, y = (t[dp_rank * local : (dp_rank + 1) * local] for t in batch(step))
        losses.append(runner.forward_backward(x, y))
        runner.clip_grad_norm(cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
    param = next(runner.parts[0].parameters())
    return {"losses": losses, "impl": optimizer_impl(optimizer), "master_dtype": param.dtype}


@pytest.fixture(scope="module")
def reference() -> dict[str, object]:
    return train_losses(0, 1, make_cfg(dtype="bf16"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("keys", "world"), [({}, 2), ({"tp": 2, "dp": 2}, 4), ({"pp": 2, "dp": 2}, 4)], ids=["dp2", "tp2-dp2", "pp2-dp2"]
)
def test_fsdp_bf16_policy_and_fused_adamw_match_autocast_within_bf16(
    reference: dict[str, object], keys: dict, world: int
) -> None:
    """The cuda profile's FSDP path (bf16 policy, fp32 master weights, fused AdamW over DTensor
    shards), alone, under TP and under pipelining, run on CPU tensors over gloo, against one process
    with bf16 autocast and foreach."""
    assert reference["impl"] == "foreach"
    for result in run(train_losses, world, make_cfg(CUDA, compile=False, **keys)):
        assert result["impl"] == "fused" and result["master_dtype"] == torch.float32
        # bf16 rounding apart (measured: ~1e-4), the same computation
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-3)


def _shard_on_fake_world(cfg: TrainConfig, rank: int, world: int) -> dict[str, str]:
    """Parallelize `cfg`'s meta model as `rank` of a fake world; the mesh's group names by dimension."""
    import torch.distributed as dist

    from launcher.compat import torch_compat as compat
    from launcher.model.init import meta_model as build
    from launcher.parallel import shard_model

    layout = from_config(cfg, world)
    dist.init_process_group("fake", store=compat.fake_store(), rank=rank, world_size=world)
    try:
        mesh = build_mesh(layout, "cpu")
        shard_model(build(cfg.model), layout, build_options(cfg, layout), mesh)
        return {dim: mesh[dim].get_group().group_name for dim in ("tp", "dp_shard")}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("keys", "armed"), [({}, True), ({"pp": 2, "pp_schedule": "interleaved_zb"}, False)])
def test_async_tp_arms_the_micro_pipeline_pass_for_the_tp_group(
    monkeypatch: pytest.MonkeyPatch, keys: dict, armed: bool
) -> None:
    """torch 2.13's micro-pipeline pass (torch/_inductor/fx_passes/micro_pipeline_tp.py) fuses a TP
    collective with its matmul only when `is_symm_mem_enabled_for_group(group)`, which reads a registry
    that only `enable_symm_mem_for_group` fills. Rank 5 of a fake world of 8 (tp=2): after parallelizing
    with async_tp=true, the check holds for its TP group and no other, and inductor's flag is set; with a
    zero-bubble schedule, whose blocks stay eager (no compile), nothing is armed."""
    import torch._inductor.config as inductor_config
    from torch.distributed import _symmetric_memory as symm_mem

    monkeypatch.setattr(symm_mem, "_group_name_to_store", {})  # what the pass reads; fresh per test
    cfg = make_cfg(CUDA, tp=2, sequence_parallel=True, async_tp=True, **keys)
    cfg.batch["global"] = 16
    # the config module's own patch: pytest's monkeypatch would delete the entry on undo
    with inductor_config.patch(_micro_pipeline_tp=False):
        groups = _shard_on_fake_world(cfg, 5, 8)
        assert inductor_config._micro_pipeline_tp is armed
    if symm_mem_needs_enabling():  # torch 2.15 arms every group where CUDA has the allocator: the flag is all
        assert symm_mem.is_symm_mem_enabled_for_group(groups["tp"]) is armed
        assert not symm_mem.is_symm_mem_enabled_for_group(groups["dp_shard"])


class Recorded:
    """Stands in for a torch function: records each call's arguments, returns `value`."""

    def __init__(self, value: object = None) -> None:
        self.calls: list[tuple[tuple, dict]] = []
        self.value = value

    def __call__(self, *args: object, **kwargs: object) -> object:
        self.calls.append((args, kwargs))
        return self.value


@pytest.mark.parametrize(("visible", "gpu"), [(8, 3), (1, 0)], ids=["node", "one-per-task"])
def test_each_rank_joins_nccl_bound_to_its_gpu_with_the_flight_recorder_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, visible: int, gpu: int
) -> None:
    """Local rank 3 of a cuda run: the GPU is its local rank modulo the GPUs it sees (a SLURM site
    binding one GPU per task shows it only device 0), set as current and bound to the NCCL group
    (`device_id`: communicators created on it at once, barriers on it); the flight recorder dumps
    under the run directory."""
    import torch.distributed as dist

    import launcher.launch.spawn
    import launcher.train.loop

    for name in (*FLIGHT_RECORDER_FILE, "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.setenv(name, "")  # recorded, so that what run_rank sets is undone
        monkeypatch.delenv(name)
    monkeypatch.setenv("RANK", "11")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("MASTER_PORT", "29500")  # torchrun's; without it the rank is refused in one line
    set_device, joined = Recorded(), []

    def init_process_group(backend, *, store=None, rank=-1, world_size=-1, timeout=None, device_id=None):  # noqa: ANN001, ANN202
        joined.append((backend, rank, world_size, device_id))

    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(launcher.train.loop, "train", lambda *args: {"trained": True})
    monkeypatch.setattr(launcher.launch.spawn, "leave_process_groups", lambda: None)
    cfg = make_cfg(CUDA)
    cfg.batch["global"] = 32  # 16 data-parallel ranks (the layout is train's, mocked here)
    assert run_rank(run_for(cfg, 16), tmp_path) == {"trained": True}
    device = torch.device("cuda", gpu)
    as_device = lambda d: torch.device("cuda", d) if isinstance(d, int) else torch.device(d)  # noqa: E731
    assert [as_device(args[0]) for args, _ in set_device.calls] == [device]
    assert joined == [("nccl", 11, 16, device)]
    dump = os.environ["TORCH_FR_DUMP_TEMP_FILE"]
    assert dump == os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "flight_recorder" / "rank_")
    assert (tmp_path / "flight_recorder").is_dir()


def test_checkpoint_barriers_run_on_this_ranks_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL's barrier allocates on a device: this rank's, not one torch guesses from the global rank."""
    import torch.distributed as dist

    from launcher.train import ckpt_write

    barrier = Recorded()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(dist, "barrier", barrier)
    ckpt_write.barrier()
    assert barrier.calls == [((), {"device_ids": [2]})]


def test_checkpoints_keep_and_restore_each_ranks_gpu_rng_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Dropout on a GPU draws from the GPU's generator: a cuda run's checkpoint keeps its state beside
    the CPU's, and resuming puts it back on that GPU. A checkpoint without one (a CPU run's, or one
    saved before) still loads and leaves the GPU's generator alone."""
    from launcher.model.init import initialized_model
    from launcher.train.checkpoint import Checkpointer, Stateful
    from launcher.train.ckpt_pick import complete_checkpoints
    from tests.conftest import tiny_config

    saved = torch.arange(16, dtype=torch.uint8)
    monkeypatch.setattr(torch.cuda, "get_rng_state", Recorded(saved))
    restore = Recorded()
    monkeypatch.setattr(torch.cuda, "set_rng_state", restore)
    cfg = tiny_config(tmp_path)
    model = initialized_model(cfg.model, cfg.seed, torch.device("cpu"))
    optimizer, _ = build_optimizer([model], cfg.optim, 4)
    gpu, cpu_run = torch.device("cuda", 1), tmp_path / "cpu"
    Checkpointer(cfg.checkpoint, tmp_path / "gpu", 0, device=gpu).save([model], optimizer, Stateful(1, {}))
    Checkpointer(cfg.checkpoint, cpu_run, 0).save([model], optimizer, Stateful(1, {}))
    assert sorted(p.name for p in (tmp_path / "gpu" / "step_00000001").glob("rng_*")) == [
        "rng_cuda_rank0.pt",
        "rng_rank0.pt",
    ]
    resumed = Checkpointer(cfg.checkpoint, tmp_path / "gpu", 0, device=gpu)
    assert resumed.load(complete_checkpoints(tmp_path / "gpu"), [model], optimizer).step == 1
    (args, _), *more = restore.calls
    assert not more and torch.equal(args[0], saved) and args[1] == gpu
    old = Checkpointer(cfg.checkpoint, cpu_run, 0, device=gpu).load(complete_checkpoints(cpu_run), [model], optimizer)
    assert old.step == 1 and len(restore.calls) == 1


def test_cuda_memory_counts_the_context_and_nccl_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's prediction is tensors + an overhead for the CUDA context and NCCL's buffers, so the
    measured figure is the device memory the process held at its peak: the allocator's peak reservation
    (8 GiB here) plus what is used outside the allocator (10 GiB used on the device - 7 reserved now),
    not the tensors' own peak (6 GiB), which the metrics keep as mem_allocated_gib."""
    from launcher.metrics.meter import Meter, memory_gib

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 7 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 8 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 6 * gib)
    device = torch.device("cuda", 0)
    assert memory_gib(device) == 11.0
    row = Meter(1024, 1e9, 1e15, 8, device).stop(1, 2.0, 1e-3, 1.0)
    assert row["mem_gib"] == 11.0 and row["mem_allocated_gib"] == 6.0
