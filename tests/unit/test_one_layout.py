"""`plan` and `train` describe the same run: the planner's step is the step the runtime runs, and
both accept and refuse the same configs, through the same rule objects (launcher/layout/rules.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from launcher.config.schema import compose_config
from launcher.data import Splits
from launcher.errors import LauncherError
from launcher.launch.cli import _train_task, plan_task
from launcher.layout import SCHEDULE, SCHEDULES, build_mesh
from launcher.layout import rules as layout_rules
from launcher.model.init import meta_model
from launcher.parallel import parallelize
from launcher.parallel.pipeline import schedule_class
from launcher.planner import build_options, resolve
from launcher.train.setup import loaders

SEQ = 16
# tiny, with layers for pp=4 x 2 virtual stages and KV heads for tp=4
MODEL = ("+model=tiny", "model.n_layers=8", "model.n_kv_heads=4", "hardware=cpu", f"seq_len={SEQ}")
BATCHES = {  # batch.micro, batch.global, microbatches
    "micro only": ("batch.micro=2",),
    "micro and global": ("batch.micro=2", "batch.global=16"),
    "micro and microbatches": ("batch.micro=1", "microbatches=8"),
    "all three": ("batch.micro=4", "batch.global=32", "microbatches=8"),
}


def cases() -> list[tuple[str, ...]]:
    out = []
    for tp, pp, schedule, batch in itertools.product((1, 2, 4), (1, 2, 4), SCHEDULES, BATCHES.values()):
        if pp == 1 and schedule != "1f1b":
            continue  # no pipeline: the schedule is not read
        v = ("virtual_stages=2",) if SCHEDULE[schedule].interleaved else ()
        out.append((f"tp={tp}", f"pp={pp}", f"pp_schedule={schedule}", *v, *batch))
    return out


def runtime_step(cfg, lay) -> tuple[int, int, int]:
    """(sequences per step, per microbatch, microbatches) as rank 0's loader and runner run them:
    the model is cut on the meta device in a fake process group of the layout's world size, then allocated."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    tokens = np.arange(4096, dtype=np.uint16) % 256
    train_loader, _ = loaders(lay, Splits(tokens, tokens, 256), build_options(cfg, lay), dp_rank=0)
    inputs, targets = train_loader.next_batch()
    model = meta_model(cfg.model)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=lay.world_size)
    try:
        runner = parallelize(model, lay, build_mesh(lay, "cpu"), build_options(cfg, lay), torch.device("cpu"))
        if lay.pp > 1:
            schedule = runner.schedule
            assert isinstance(schedule, schedule_class(lay.schedule))
            count = schedule._n_microbatches  # what schedule.step splits the rank's batch into
            per_microbatch = inputs.shape[0] // count
        else:
            chunks = runner.microbatches(inputs, targets)
            count, per_microbatch = len(chunks), chunks[0][0].shape[0]
    finally:
        dist.destroy_process_group()
    assert train_loader.global_batch == inputs.shape[0] * lay.dp
    return inputs.shape[0] * lay.dp, per_microbatch, count


@pytest.mark.parametrize("overrides", cases(), ids=" ".join)
def test_the_planned_step_is_the_step_that_runs(overrides: tuple[str, ...]) -> None:
    cfg = compose_config(*MODEL, *overrides)
    lay, prediction, _ = resolve(cfg)
    sequences, per_microbatch, count = runtime_step(cfg, lay)
    assert prediction.layout == lay
    assert prediction.tokens_per_step == sequences * SEQ
    assert prediction.tokens_per_microbatch == per_microbatch * SEQ
    assert prediction.as_dict()["microbatches"] == count
    assert per_microbatch == cfg.batch["micro"]  # batch.micro: sequences per microbatch, whatever pp
    if cfg.batch["global"]:
        assert sequences == cfg.batch["global"]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_the_searched_step_is_the_step_that_runs(world: int) -> None:
    """Keys left auto: the planner's best layout (inside torchrun of `world` ranks) runs as planned."""
    auto = ("tp=auto", "pp=auto", "pp_schedule=auto", "recompute=auto", "batch.micro=auto", "batch.global=32")
    cfg = compose_config(*MODEL, *auto)
    lay, prediction, _ = resolve(cfg, world)
    sequences, per_microbatch, count = runtime_step(cfg, lay)
    assert lay.world_size == world and sequences == 32
    assert (prediction.tokens_per_step, prediction.tokens_per_microbatch) == (sequences * SEQ, per_microbatch * SEQ)
    assert prediction.as_dict()["microbatches"] == count


def test_microbatches_follow_micro_and_global_batch_under_pp() -> None:
    """pp=2 batch.micro=8: 4 microbatches of 8; pp=2 batch.micro=4 batch.global=32: 8 of 4."""
    for overrides, expected in ((("batch.micro=8",), (32, 8, 4)), (("batch.micro=4", "batch.global=32"), (32, 4, 8))):
        cfg = compose_config(*MODEL, "pp=2", *overrides)
        lay, prediction, _ = resolve(cfg)
        assert runtime_step(cfg, lay) == expected
        assert prediction.tokens_per_step == expected[0] * SEQ


BAD = [  # (tp, pp, dp), further overrides, the one line both print
    ((1, 1, 1), ("seq_len=2048",), "seq_len=2048 exceeds model.max_seq_len=1024"),
    ((3, 1, 1), (), "tp=3 does not divide model.n_heads=8"),
    ((2, 1, 1), ("model.vocab_size=257",), "tp=2 does not divide model.vocab_size=257"),
    ((1, 8, 1), (), "8 stages exceed model.n_layers=4"),
    (
        (1, 2, 1),
        ("model.tied_embeddings=true", "pp_schedule=dualpipev", "virtual_stages=2", "microbatches=4"),
        "model.tied_embeddings=true with pp_schedule=dualpipev",
    ),  # fmt: skip
    ((1, 1, 1), ("virtual_stages=2",), "virtual_stages=2 schedules pipeline stages, and pp=1 has none"),
    ((1, 1, 1), ("sequence_parallel=true",), "sequence_parallel=true needs tensor parallelism"),
    ((2, 1, 1), ("sequence_parallel=true", "seq_len=33"), "seq_len=33 must be a multiple of tp=2"),
    ((1, 2, 1), ("microbatches=1",), "1 microbatches per step cannot fill pp=2 stages"),
    ((1, 1, 1), ("cp=2", "seq_len=30", "hardware.devices_per_node=2"), "seq_len=30 is not a multiple of 4"),
    ((1, 2, 1), ("pp_schedule=interleaved_1f1b", "microbatches=3"), "microbatches=3 is not a multiple of pp=2"),
    ((1, 1, 1), ("batch.global=12",), "batch.global=12 is not a multiple of batch.micro x dp = 8 x 1"),
    ((1, 2, 2), ("microbatches=2", "batch.global=64"), "microbatches=2 but batch.global / (batch.micro x dp)"),
    ((1, 1, 1), ("batch.micro=0",), "batch.micro=0 is out of range: use an integer >= 1 or auto"),
    ((1, 1, 1), ("model.norm=batchnorm",), "model.norm=batchnorm: choose one of rmsnorm, layernorm"),
]
GOOD = [((2, 2, 1), ()), ((1, 2, 2), ("batch.global=64",)), ((2, 1, 2), ("sequence_parallel=true",))]


def entry_configs(degrees: tuple[int, int, int], overrides: tuple[str, ...]):
    """The same config as `train` and `plan` compose it: plan's world (nodes x devices) set to the
    degrees' product, and its searched keys given the values train defaults to."""
    tp, pp, dp = degrees
    given = (f"tp={tp}", f"pp={pp}", f"dp={dp}", "+model=small", "hardware=cpu")
    train_cfg = compose_config(*given, "dry_run=true", *overrides)
    plan_keys = ("pp_schedule=1f1b", "recompute=none", "batch.micro=8", "plan.explore=false", "plan.top=1")
    plan_cfg = compose_config(
        *given, f"hardware.devices_per_node={tp * pp * dp}", *plan_keys, *overrides, config_name="plan"
    )
    return train_cfg, plan_cfg


RULE_NAMES = {rule.__name__ for rule in layout_rules.RULES}


@pytest.fixture
def rule_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every call of a layout rule, by name: the rule objects both entry points must go through."""
    calls: list[str] = []

    def spy(rule):
        def called(*args):
            calls.append(rule.__name__)
            return rule(*args)

        return called

    monkeypatch.setattr(layout_rules, "RULES", tuple(spy(r) for r in layout_rules.RULES))
    return calls


@pytest.mark.parametrize("degrees, overrides, message", BAD, ids=[" ".join(o) or str(d) for d, o, _ in BAD])
def test_plan_and_train_refuse_alike(degrees, overrides, message) -> None:
    train_cfg, plan_cfg = entry_configs(degrees, overrides)
    errors = []
    for task, cfg in ((_train_task, train_cfg), (plan_task, plan_cfg)):
        with pytest.raises(LauncherError) as err:
            task(cfg)
        errors.append(str(err.value))
    assert message in errors[0] and "\n" not in errors[0]
    assert errors[1] == errors[0]


@pytest.mark.parametrize("degrees, overrides", GOOD)
def test_plan_and_train_accept_alike_through_the_same_rules(degrees, overrides, rule_calls, capsys) -> None:
    train_cfg, plan_cfg = entry_configs(degrees, overrides)
    _train_task(train_cfg)  # a dry run: resolved and cut, nothing started
    from_train, rule_calls[:] = list(rule_calls), []
    plan_task(plan_cfg)
    assert set(from_train) == set(rule_calls) == RULE_NAMES, "both entry points apply every rule"
    assert f"tp={degrees[0]} pp={degrees[1]} dp={degrees[2]}" in capsys.readouterr().out
