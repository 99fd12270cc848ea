"""`ft`: replica groups on torchft (docs/fault-tolerance.md). Bad input is refused in one line before
anything starts; with every group alive, a run of 2 groups x 1 rank has the losses of the same run
without `ft` (one DDP layout of 2 ranks)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from launcher.config.extras import installed
from launcher.config.ft import FtConfig, check_ft
from launcher.data import BatchLoader
from launcher.errors import LauncherError
from launcher.launch.spawn import launch
from launcher.train import replicas
from launcher.train.ckpt_pick import complete_checkpoints
from launcher.train.faults import TEST_KILL_ENV
from launcher.train.spike import SpikeGuard, Trainee
from launcher.train.untrusted import EXTRAS
from tests.conftest import losses, make_config, run_cli, run_for, tiny_args, tiny_config


class Averaging:
    """torchft's Manager as `sync` uses it: records what it all-reduces (the other group is all zeros)."""

    def __init__(self) -> None:
        self.reduced: list[torch.Tensor] = []

    def allreduce(self, flat: torch.Tensor) -> Any:
        self.reduced.append(flat)
        if flat.device.type != "meta":
            flat.div_(2)
        return DoneWork()


class DoneWork:
    def wait(self) -> None:
        pass


def group(manager: Averaging) -> replicas.Replicas:
    """A Replicas with only what `sync` reads (its Manager a stand-in)."""
    r = replicas.Replicas.__new__(replicas.Replicas)
    r.step, r.kill_step, r.manager = 1, None, manager
    r.backward_done = replicas.threading.Event()
    return r


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_sync_reduces_on_the_gradients_device_in_buckets(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the loss and every bucket must be CUDA tensors beside the gradients (a CPU loss concatenated
    with CUDA gradients crashed the first step): `meta` stands in for a device that is not the CPU."""
    manager = Averaging()
    monkeypatch.setattr(replicas, "BUCKET_BYTES", 64 * 4)  # 64 fp32 values a bucket
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 100)).to(device)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    if device == "meta":
        with pytest.raises(RuntimeError, match="meta"):  # the loss's float() of a meta tensor: nothing else fails
            group(manager).sync([model], 2.0)
    else:
        assert group(manager).sync([model], 2.0) == 1.0
        assert all(float(p.grad.min()) == float(p.grad.max()) == 0.5 for p in model.parameters())
    assert {t.device.type for t in manager.reduced} == {device}
    # 32 + 4 in one bucket; 400 and 100, each over a bucket, alone (reduced in place); the loss
    assert [t.numel() for t in manager.reduced] == [36, 400, 100, 1]


def test_buckets_keep_order_and_dtype() -> None:
    tensors = [torch.zeros(10), torch.zeros(10), torch.zeros(3, dtype=torch.bfloat16), torch.zeros(30), torch.zeros(5)]
    cut = replicas.buckets(tensors, 4 * 20)
    assert [[t.numel() for t in b] for b in cut] == [[10, 10], [3], [30], [5]]


def test_ft_off_by_default_and_at_one_replica() -> None:
    assert not FtConfig().on
    assert not FtConfig(replicas=1).on
    check_ft(FtConfig(replicas=1, min_replicas=5), 3)  # off: nothing to check


@pytest.mark.parametrize(
    ("ft", "dp_replicate", "message"),
    [
        (FtConfig(replicas=2), 3, "ft.replicas=2: does not divide dp_replicate=3"),
        (FtConfig(replicas=2, min_replicas=3), 2, "ft.min_replicas=3: more than ft.replicas=2"),
    ],
)
def test_bad_ft_is_one_line(ft: FtConfig, dp_replicate: int, message: str) -> None:
    with pytest.raises(LauncherError, match=message) as err:
        check_ft(ft, dp_replicate)
    assert "\n" not in str(err.value)


def test_ft_without_torchft_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("launcher.config.extras.installed", lambda module: module != "torchft")
    with pytest.raises(LauncherError, match=r"ft.replicas=2 needs the torchft package: pip install 'launcher\[ft\]'"):
        check_ft(FtConfig(replicas=2), 2)


needs_torchft = pytest.mark.skipif(not installed("torchft"), reason="the ft extra (torchft) is not installed")
LAYOUT = ("dp=2", "dp_replicate=2", "dp_shard=1", "steps=4", "checkpoint.every=0")
# 2 groups x 2 ranks: FSDP over each group's 2 ranks, so that each rank heals its own shards
TWO_RANKS = ("dp=4", "dp_replicate=2", "dp_shard=2")


@needs_torchft
@pytest.mark.slow
@pytest.mark.parametrize("shape", [(), TWO_RANKS], ids=["1_rank", "2_ranks"])
def test_two_groups_train_as_one_layout(tmp_path: Path, shape: tuple[str, ...]) -> None:
    """2 groups x 1 rank (ft) against one layout of 2 DDP ranks, and 2 groups x 2 FSDP ranks against one
    HSDP layout of 4 ranks: the same samples, the same losses."""
    plain = tmp_path / "plain"
    launch(run_for(tiny_config(tmp_path, *LAYOUT, *shape), None), plain)
    ft = tmp_path / "ft"
    cfg = tiny_config(tmp_path, *LAYOUT, *shape, "ft.replicas=2", "ft.min_replicas=2", "ft.quorum_timeout_s=30")
    summary = launch(run_for(cfg, None), ft)
    assert summary["replicas"] == 2
    expected = losses(plain)
    assert len(expected) == 4
    for run_dir in (ft, ft / "replica_1"):  # each group logs the loss averaged over both
        assert losses(run_dir) == pytest.approx(expected, rel=1e-5)
    rows = [json.loads(line) for line in (ft / "metrics.jsonl").read_text().splitlines()]
    assert [row["replicas"] for row in rows] == [2, 2, 2, 2]


def final_state(run_dir: Path) -> dict[str, Any]:
    """The newest complete checkpoint under `run_dir`, as one plain state dict (DCP read without a process
    group: every rank's shards), with its extras (loader, schedule, spike guard)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    newest = complete_checkpoints(run_dir / "checkpoints")[0]
    dcp_to_torch_save(newest, run_dir / "final.pt")
    extras = json.loads((newest / EXTRAS).read_text())
    return torch.load(run_dir / "final.pt", weights_only=False) | {"extras": extras}


def assert_same(ours: Any, theirs: Any, where: str = "") -> None:
    """Bitwise equal, through nested dicts and lists."""
    if isinstance(ours, dict):
        assert ours.keys() == theirs.keys(), where
        for key in ours:
            assert_same(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(ours, list | tuple):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(ours, torch.Tensor):
        assert torch.equal(ours, theirs), where
    else:
        assert ours == theirs, where


class Quiet:
    """A spike guard's checkpointer (never due) and console (notes dropped), in one process without a run."""

    root = Path("no-checkpoints")

    def due(self, step: int, last_step: int) -> bool:
        return False

    def wait(self) -> None:
        pass

    def note(self, line: str) -> None:
        pass


def spike_guard(seed: int) -> SpikeGuard:
    """`guard.spike=rollback` on a linear model and AdamW (weights from `seed`): checked from step 4 (a window
    of 3, no warm-up), a snapshot every 4 steps."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
    loader = BatchLoader(np.arange(5000, dtype=np.uint16), 8, 4)
    trainee = Trainee([model], optimizer, schedule, loader, torch.device("cpu"))
    cfg = make_config("guard.spike=rollback", "guard.warmup=0", "guard.window=3", "guard.snapshot_every=4").guard
    return SpikeGuard(cfg, trainee, Quiet(), [], Quiet(), None)


def train(spikes: SpikeGuard, step: int, losses: list[float]) -> list[int]:
    """The loop's order (launcher/train/loop.py) from `step` on, each step's loss (also its gradient norm,
    and every gradient) given: the steps trained, in order."""
    t, trained = spikes.state, []
    for loss in losses:
        spikes.keep(step, 100)
        step += 1
        t.loader.next_batch()
        for p in t.parts[0].parameters():
            p.grad = torch.full_like(p, loss)
        if spikes.update(step, loss, loss):
            t.optimizer.step()
        t.optimizer.zero_grad()
        if spikes.rolled_back_to is not None:
            step = spikes.rolled_back_to
            continue
        t.schedule.step()
        trained.append(step)
    return trained


def everything(spikes: SpikeGuard) -> list[Any]:
    """What a peer sends: the model, optimizer, schedule, loader and spike guard."""
    t = spikes.state
    parts = (t.parts[0], t.optimizer, t.schedule, t.loader)
    return [part.state_dict() for part in parts] + [spikes.peer_state()]


def test_a_healing_group_takes_its_peers_spike_guard() -> None:
    """A group healing from a peer (launcher/train/replicas.py, `state` and `load_state`) takes the peer's
    spike guard with the rest: the window (its own restarted empty), the rollback count and, under
    `rollback`, the snapshot (its own is of its step 0). Then both decide alike: the spike at step 7 rolls
    both back to the peer's snapshot of step 4, their second rollback, and they end equal."""
    peer, healed = spike_guard(0), spike_guard(1)
    assert train(peer, 0, [1.0, 1.0, 1.0, 1.0, 50.0, 1.0]) == [1, 2, 3, 4, 5]  # step 5 spikes: back to 4
    healed.keep(0, 100)  # restarted: its snapshot before its first step
    sent = io.BytesIO()  # torchft's transport: a copy
    torch.save(everything(peer), sent)
    sent.seek(0)
    model, optim, schedule, loader, spike = torch.load(sent, weights_only=False)
    t = healed.state
    t.parts[0].load_state_dict(model), t.optimizer.load_state_dict(optim), t.schedule.load_state_dict(schedule)
    t.loader.load_state_dict(loader)
    healed.load_peer_state(spike)
    steps = [1.0, 50.0, 1.0, 1.0]  # step 7 spikes
    assert train(peer, 5, steps) == train(healed, 5, steps) == [6, 5, 6]
    assert peer.rollbacks == healed.rollbacks == 2 and healed.state.loader.skipped == [[5, 5], [5, 8]]
    assert_same(everything(healed), everything(peer))


# (ranks a group, steps, ft.heartbeat_timeout_s): the survivor stalls while the dead group still counts as
# alive; 1 rank: 6 s, while group 1's restart is under way (it must be back before the survivor's last
# step); 2 ranks: 2 s, so that the group heals while the survivor steps (the survivor's quorum, and its
# `state` for the peer, overlap its FSDP forward: launcher/train/replicas.py)
KILLED = [(1, 400, 6), (2, 300, 2)]


@needs_torchft
@pytest.mark.slow
@pytest.mark.parametrize(("ranks", "steps", "heartbeat_s"), KILLED, ids=["1_rank", "2_ranks"])
def test_killed_group_restarts_and_heals_from_its_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ranks: int, steps: int, heartbeat_s: int
) -> None:
    """Group 1's rank 0 dies at step 3 (SIGKILL, first life only; its agent ends the group's other rank):
    group 0 steps on alone, group 1's agent restarts the group, each of its ranks takes the same rank's
    state of group 0 in a quorum, and it ends bitwise equal to group 0, the spike guard's window included
    (no warm-up, a window of every step: a healed group that started its own would differ)."""
    monkeypatch.setenv(TEST_KILL_ENV, "3:1")
    timeout_s = 20.0
    layout = LAYOUT if ranks == 1 else TWO_RANKS
    overrides = (f"steps={steps}", f"checkpoint.every={steps}", "max_restarts=1", "metrics.log_every=1")
    overrides += ("guard.warmup=0", f"guard.window={steps}")
    ft = ("ft.replicas=2", "ft.min_replicas=1", f"ft.quorum_timeout_s={timeout_s}")
    ft += (f"ft.heartbeat_timeout_s={heartbeat_s}",)
    summary = launch(run_for(tiny_config(tmp_path, *layout, *overrides, *ft), None), tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, steps + 1))  # each once: the survivor never restarted
    gaps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:], strict=False)]
    assert max(gaps) < timeout_s
    alone = [row["step"] for row in rows if row["replicas"] == 1]
    assert alone[0] == 3 and rows[-1]["replicas"] == 2  # alone from the kill until group 1 healed
    assert alone == list(range(3, alone[-1] + 1))
    assert summary["ft_short_steps"] == alone
    assert summary["ft_tokens_missed"] == len(alone) * ranks * 4 * 32  # group 1's batch of each (4 x 32 a rank)
    ours, theirs = final_state(tmp_path / "run"), final_state(tmp_path / "run" / "replica_1")
    assert len(ours["extras"]["spike"]["window"]["losses"]) == steps
    assert_same(ours, theirs)


SIX = (*LAYOUT, "steps=6", "checkpoint.every=4")
FT = ("ft.replicas=2", "ft.min_replicas=2", "ft.quorum_timeout_s=30")


@pytest.fixture(scope="module")
def ft_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 2 groups x 1 rank, 6 steps, checkpoints at steps 4 and 6."""
    tmp = tmp_path_factory.mktemp("ft_run")
    launch(run_for(tiny_config(tmp, *SIX, *FT), None), tmp / "run")
    return tmp / "run"


@needs_torchft
@pytest.mark.slow
@pytest.mark.parametrize("ft", [(), FT], ids=["ft_off", "ft_on"])
def test_a_checkpoint_of_two_groups_resumes_the_whole_job(ft_run: Path, ft: tuple[str, ...], tmp_path: Path) -> None:
    """Group 0's checkpoint at step 4 of 6 is the whole job's: resumed without ft (one layout of 2 DDP
    ranks) or with ft (each group loads it), steps 5 and 6 have the ft run's losses."""
    expected = losses(ft_run)
    step4 = ft_run / "checkpoints" / "step_00000004"
    summary = launch(run_for(tiny_config(tmp_path, *SIX, f"resume={step4}", *ft), None), tmp_path / "run")
    assert summary["steps"] == 6
    assert losses(tmp_path / "run") == pytest.approx({5: expected[5], 6: expected[6]}, rel=1e-5)


@needs_torchft
@pytest.mark.slow
def test_a_group_back_after_the_run_ended_trains_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    """Group 1 dies at step 3 of 30; group 0 steps on alone and finishes before group 1's agent has it back
    (its next life waits for that: `late`, a restart being quick). The restarted group finds the run ended:
    it trains nothing, and `train` returns without waiting for it to train the run alone. The death is two
    lines on the terminal (the agent's and the survivor's), no tracebacks."""
    monkeypatch.setenv(TEST_KILL_ENV, "3:1:late")
    overrides = ("steps=30", "checkpoint.every=30", "max_restarts=1", "metrics.log_every=1")
    ft = ("ft.replicas=2", "ft.min_replicas=1", "ft.quorum_timeout_s=60", "ft.heartbeat_timeout_s=1")
    summary = launch(run_for(tiny_config(tmp_path, *LAYOUT, *overrides, *ft), None), tmp_path / "run")
    assert summary["steps"] == 30 and summary["ft_short_steps"] == list(range(3, 31))
    assert [row["step"] for row in map(json.loads, (tmp_path / "run" / "metrics.jsonl").open())] == list(range(1, 31))
    # group 1: its first life's two steps, then nothing (its second life found the run ended)
    assert list(losses(tmp_path / "run" / "replica_1")) == [1, 2]
    err = capfd.readouterr().err
    assert "failed (exitcode: -9)" in err and "got exception waiting for work" in err
    assert "Traceback" not in err and "flight recorder" not in err, err


@needs_torchft
@pytest.mark.slow
def test_the_terminal_reads_as_one_run(tmp_path: Path) -> None:
    """Through the CLI, 2 groups x 1 rank: a line on the groups, then group 0's header, step lines and
    summary alone (group 1's go to its console.log), a closing line for group 1 and one naming whose
    summary it is, with each group's validation loss (each validates its own share of the batches)."""
    run_dir = tmp_path / "run"
    args = (*tiny_args(tmp_path / "cache"), *LAYOUT, "metrics.console=plain", "eval.every=4", *FT, f"run_dir={run_dir}")
    result = run_cli("train", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    opening = [line for line in lines if line.startswith("ft: 2 replica groups x world 1, quorum 2, lighthouse ")]
    assert len(opening) == 1 and opening[0].endswith(f"group 0 prints here, group 1 to {run_dir}/replica_1/console.log")
    assert lines[0] == opening[0] and sum(line.startswith("tiny ") for line in lines) == 1  # one run header
    assert [line.split()[0] for line in lines if line.startswith("step=")] == [f"step={s}" for s in range(1, 5)]
    assert sum(line.startswith("summary") for line in lines) == 1
    assert any(line.startswith("[g1] ended: 4 steps, loss ") for line in lines), result.stdout
    g0, g1 = (json.loads((d / "summary.json").read_text())["val_loss"] for d in (run_dir, run_dir / "replica_1"))
    closing = "ft: the summary above is group 0's, of 2 groups"
    assert lines[-1] == closing + f"; val loss {(g0 + g1) / 2:.4f} over the groups (g0 {g0:.4f} · g1 {g1:.4f})"
    log = (run_dir / "replica_1" / "console.log").read_text()
    assert sum(line.startswith("step=") for line in log.splitlines()) == 4 and "[g1]" not in result.stderr
