"""Rank order, DeviceMesh, pipeline split, layout errors (one line, before any worker), dry run."""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import replace

import pytest

from launcher.config.layout_keys import check_environment, from_config
from launcher.errors import LauncherError
from launcher.layout import Layout, owner_rank, rank_of, rank_stages, stage_layers
from launcher.planner import build_options, resolve
from tests.conftest import make_config, run_cli


def test_rank_order_tp_innermost_then_dp_then_pp() -> None:
    layout = Layout(tp=2, pp=2, dp_replicate=2, dp_shard=2)
    order = [layout.coordinates(r) for r in range(layout.world_size)]
    assert [c["tp"] for c in order[:4]] == [0, 1, 0, 1]  # neighbours share a tensor-parallel group
    assert [c["dp_shard"] for c in order[:4]] == [0, 0, 1, 1]
    assert [c["dp_replicate"] for c in order[:8]] == [0] * 4 + [1] * 4
    assert [c["pp"] for c in order] == [0] * 8 + [1] * 8  # pipeline stages are the outermost blocks
    for r, c in enumerate(order):
        assert rank_of(layout, c["pp"], c["dp_replicate"], c["dp_shard"], c["tp"]) == r
        assert c["dp"] == c["dp_replicate"] * layout.dp_shard + c["dp_shard"]
    assert owner_rank(layout) == 8  # rank 0 of the last pipeline stage
    assert owner_rank(Layout(tp=4, pp=1, dp_shard=2)) == 0


def test_cp_sits_between_tp_and_dp() -> None:
    layout = Layout(tp=2, cp=2, dp_shard=2, pp=2)
    order = [layout.coordinates(r) for r in range(layout.world_size)]
    assert [c["cp"] for c in order[:8]] == [0, 0, 1, 1] * 2 and [c["dp_shard"] for c in order[:8]] == [0] * 4 + [1] * 4
    for r, c in enumerate(order):
        assert rank_of(layout, c["pp"], c["dp_replicate"], c["dp_shard"], c["tp"], c["cp"]) == r
    assert layout.world_size == 16 and layout.fsdp_shard == 4 and layout.sharding == "fsdp"
    assert Layout(cp=2).sharding == "fsdp" and Layout(cp=2, dp_replicate=2).sharding == "hsdp"


def test_device_mesh_follows_the_rank_order() -> None:
    """The mesh built on a fake 16-rank world: every named group is the ranks the order predicts."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from launcher.layout import build_mesh

    layout = Layout(tp=2, pp=2, dp_replicate=2, dp_shard=2, cp=2)
    for rank in (0, 5, 13, 30):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
        try:
            mesh = build_mesh(layout, "cpu")
            c = layout.coordinates(rank)
            dims = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
            for dim in dims:
                expected = [rank_of(layout, **{**{k: c[k] for k in dims}, dim: i}) for i in range(getattr(layout, dim))]
                assert mesh[dim].mesh.tolist() == expected, (rank, dim)
                assert mesh[dim].get_local_rank() == c[dim]
            shard_cp = [
                rank_of(layout, **{**{k: c[k] for k in dims}, "dp_shard": s, "cp": i}) for s in (0, 1) for i in (0, 1)
            ]
            assert mesh["dp_shard_cp"].mesh.tolist() == shard_cp  # FSDP's group: dp_shard x cp
        finally:
            dist.destroy_process_group()


def test_layers_split_evenly_extra_layers_to_the_first_stages() -> None:
    assert stage_layers(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert stage_layers(10, 4) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert stage_layers(4, 3) == [[0, 1], [2], [3]]
    for n, s in itertools.product(range(1, 12), range(1, 6)):
        if s <= n:
            parts = stage_layers(n, s)
            assert sum(parts, []) == list(range(n)) and max(map(len, parts)) - min(map(len, parts)) <= 1
    assert rank_stages(1, 2, 2) == [1, 3]  # looped placement of interleaved 1F1B


def error(*overrides: str, world_size: int | None = None) -> str:
    cfg = make_config("+model=small", *overrides)
    with pytest.raises(LauncherError) as info:
        layout, _, _ = resolve(cfg, world_size)
        check_environment(cfg, layout, local=world_size is None)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (("tp=3",), r"tp=3 does not divide model.n_heads=8 .*use tp in \{1, 2, 4\}"),
        (("tp=8",), r"tp=8 does not divide model.n_kv_heads=4 .*\{1, 2, 4\}"),
        (("tp=4", "model.ffn_dim=690"), r"tp=4 does not divide model.ffn_dim=690 .*\{1, 2\}"),
        (("tp=2", "model.vocab_size=257"), r"tp=2 does not divide model.vocab_size=257 .*\{1\}"),
        (("pp=8",), r"8 stages exceed model.n_layers=4"),
        (("pp=2", "virtual_stages=3", "pp_schedule=interleaved_1f1b"), r"6 stages exceed model.n_layers=4"),
        (("pp=2", "virtual_stages=2"), r"virtual_stages=2 needs pp_schedule=interleaved_1f1b"),
        (("virtual_stages=2",), r"virtual_stages=2 schedules pipeline stages, and pp=1 has none"),
        (("pp=2", "microbatches=1"), r"1 microbatches per step cannot fill pp=2 stages"),
        (("pp=4", "batch.micro=2", "batch.global=4"), r"2 microbatches per step cannot fill pp=4 stages"),
        (("pp=2", "batch.global=12"), r"batch.global=12 is not a multiple of batch.micro x dp = 8 x 1"),
        (("pp=2", "microbatches=3", "batch.global=32"), r"microbatches=3 but batch.global / \(batch.micro x dp\)"),
        (("pp=2", "pp_schedule=interleaved_1f1b", "microbatches=3"), r"microbatches=3 is not a multiple of pp=2"),
        (
            ("pp=2", "pp_schedule=zbv", "virtual_stages=2", "model.tied_embeddings=true"),
            r"model.tied_embeddings=true with pp_schedule=zbv: .* use pp_schedule=interleaved_zb or 1f1b",
        ),
        (("sequence_parallel=true",), r"sequence_parallel=true needs tensor parallelism"),
        (("tp=2", "sequence_parallel=true", "seq_len=33"), r"seq_len=33 must be a multiple of tp=2"),
        (("cp=2", "seq_len=30"), r"cp=2 splits each sequence into 2 x cp = 4 equal chunks: seq_len=30 is not a mult"),
        (("cp=3", "seq_len=64"), r"seq_len=64 is not a multiple of 6: use seq_len=66 or cp in \{2, 4, 8, 16, 32\}"),
        (("cp=2", "tp=4", "sequence_parallel=true", "seq_len=36"), r"seq_len=36 must be a multiple of tp=4 x cp=2"),
        (("hardware=h200", "tp=2", "cp=2", "dp=1"), r"tp\*pp\*cp\*dp=2\*1\*2\*1=4 does not match the world size 8"),
        (("tp=2", "dp=8"), r"16 local workers, more than max_local_workers=8"),
        (("hardware=h200", "tp=4", "pp=2"), r"no CUDA device"),
        (("hardware=h200", "tp=2", "dp=2"), r"tp\*pp\*dp=2\*1\*2=4 does not match the world size 8"),
    ],
)
def test_bad_layouts_fail_with_one_line_naming_key_and_fix(overrides: tuple[str, ...], expected: str) -> None:
    assert re.search(expected, error(*overrides)), error(*overrides)


def test_world_size_from_torchrun_must_match_the_degrees() -> None:
    assert "does not match the world size 6" in error("tp=2", "dp=2", world_size=6)


def test_valid_layouts_pass() -> None:
    for overrides, degrees in (
        (("tp=4",), (4, 1, 1, 4)),
        (("pp=3",), (1, 3, 1, 3)),
        (("tp=2", "pp=2", "dp=2"), (2, 2, 2, 8)),
        (("hardware=h200", "tp=4", "pp=2", "dry_run=true"), (4, 2, 1, 8)),  # dp fills the node's 8 GPUs
    ):
        cfg = make_config("+model=small", *overrides)
        layout, _, _ = resolve(cfg)
        assert (layout.tp, layout.pp, layout.dp, layout.world_size) == degrees, overrides
        if not cfg.dry_run:  # as the CLI: a dry run needs no devices
            check_environment(cfg, layout, local=True)


@pytest.mark.slow
def test_cli_rejects_a_bad_layout_before_any_worker_starts(tmp_path) -> None:
    result = run_cli("train", "tp=3", "dp=2", f"run_dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "tp=3 does not divide model.n_heads=8" in result.stderr
    assert not list(tmp_path.glob("rank*.log"))


@pytest.mark.slow
def test_dry_run_8b_tp8_from_the_cli(tmp_path) -> None:
    result = run_cli("train", "+model=8b", "tp=8", "dry_run=true", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "ranks 0-7 hold (3.740 GiB of parameters each):" in out
    assert re.search(r"feed_forward.w1.weight\s+\(1792, 4096\) of \(14336, 4096\)", out)
    assert re.search(r"attention.wk.weight\s+\(128, 4096\) of \(1024, 4096\)", out)  # 8 KV heads / 8
    assert re.search(r"rank\s+7 \(pp 0 dp 0 tp 7, stages \[0\]\):\s+3.740 GiB ·\s+14.961 GiB", out)
    assert "total over ranks: 29.92 GiB" in out  # 8.03 B parameters x 4 bytes, all held exactly once
    assert not (tmp_path / "outputs").exists()  # a dry run writes nothing: no folder of Hydra's files alone


def test_dry_run_70b_tp8_pp4_dp2_ranks() -> None:
    """The first and the last pipeline stage as built, and shard shapes of other ranks."""
    from launcher.launch.dryrun import build_rank, local_shapes

    cfg = make_config("+model=70b", "tp=8", "pp=4", "dp=2", "dry_run=true")
    layout, _, _ = resolve(cfg)
    params, first, stages = build_rank(cfg.model, layout, build_options(cfg, layout), 0)
    assert stages == [0]
    assert first["tok_embeddings.weight"] == (8016, 8192)  # 128256 / tp 8 / dp_shard 2
    assert (
        "output.weight" not in first
        and "layers.19.ffn_norm.weight" in first
        and "layers.20.ffn_norm.weight" not in first
    )
    params, last, stages = build_rank(cfg.model, layout, build_options(cfg, layout), 63)
    assert stages == [3] and "output.weight" in last and "layers.79.attention.wq.weight" in last
    assert last["layers.79.feed_forward.w2.weight"] == (4096, 3584)  # (8192 / dp_shard 2, 28672 / tp 8)
    assert local_shapes(params, layout, 50) == last  # same stage, other tp / dp coordinates, even shards
    nbytes = sum(math.prod(s) * 4 for s in last.values())
    assert 4.2 < nbytes / 2**30 < 4.3  # a middle stage holds 3.99 GiB: no embedding or output


@pytest.mark.parametrize(
    "overrides",
    [
        ("tp=2", "dp=3", "pp=2"),  # FSDP over 3: uneven shards (dim 32 -> 11, 11, 10)
        ("tp=2", "dp=4", "dp_replicate=2", "dp_shard=2", "sequence_parallel=true"),  # HSDP
        ("dp=3", "dp_shard=1", "pp=3", "pp_schedule=interleaved_1f1b", "virtual_stages=2", "microbatches=3"),
        ("tp=2", "cp=3", "dp=2", "dp_replicate=2", "seq_len=36"),  # HSDP over dp_replicate x (dp_shard x cp)
    ],
)
def test_dry_run_derived_shapes_equal_building_every_rank(overrides: tuple[str, ...]) -> None:
    from launcher.launch.dryrun import build_rank, local_shapes

    cfg = make_config(
        "+model=tiny", "model.n_layers=6", "model.dim=32", "model.ffn_dim=90", "batch.micro=3", *overrides
    )
    layout = from_config(cfg, None)
    representative = {}
    for rank in range(layout.world_size):
        params, built, _ = build_rank(cfg.model, layout, build_options(cfg, layout), rank)
        representative.setdefault(layout.coordinates(rank)["pp"], params)
        assert local_shapes(representative[layout.coordinates(rank)["pp"]], layout, rank) == built, rank


def test_a_layout_reads_in_one_line_naming_what_differs_from_one_process() -> None:
    from launcher.layout import describe

    assert describe(Layout()) == "one process · micro 1 x 1"
    lay = Layout(tp=8, sequence_parallel=True, pp=4, schedule="interleaved_1f1b", virtual_stages=2, dp_shard=2)
    text = describe(replace(lay, recompute="selective", micro=1, microbatches=8))
    assert text == "tp 8 sp · pp 4 interleaved x2 · dp 2 fsdp zero2 · selective recompute · micro 1 x 8"
    assert "2 blocks full recompute" in describe(Layout(dp_replicate=2, dp_shard=4, recompute_layers=2))


def test_each_schedule_row_names_a_torch_class_of_its_kind() -> None:
    """Every row of the schedule table resolves to the class that runs it, one stage or a list as the
    row says (`multi_stage`), and the names `pp_schedule` accepts are the table's."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    from launcher.config.validate import CHOICES
    from launcher.layout import SCHEDULE
    from launcher.parallel.pipeline import schedule_class

    assert CHOICES["pp_schedule"] == (*SCHEDULE, "auto")
    for name, row in SCHEDULE.items():
        kind = PipelineScheduleMulti if row.multi_stage else PipelineScheduleSingle
        assert issubclass(schedule_class(name), kind), name
        assert row.v_shape <= (row.virtual == 2) and row.zero_bubble <= row.multi_stage, name
        assert row.virtual_tries() and row.bubble(1, row.virtual_tries()[0], 4) == 0.0, name  # no hop, no bubble


def test_a_new_schedule_is_one_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row added to the table is read by the rules, the runtime's class lookup, the planner's bubble
    and activations in flight, the report's text and the search, with nothing else to edit."""
    from launcher.config.model import ModelConfig
    from launcher.layout import SCHEDULE, Schedule, schedule_text, violations
    from launcher.layout.schedules import _one_logits
    from launcher.parallel.pipeline import schedule_class
    from launcher.planner.cost import bubble_slots
    from launcher.planner.search import Space, _schedules
    from launcher.planner.timeline import in_flight, logits_in_flight

    row = Schedule(
        name="looped_half", runtime="torch.distributed.pipelining.ScheduleInterleaved1F1B", virtual=None,
        bubble=lambda p, v, m: (p - 1) / (2 * v), in_flight=lambda p, v, m, r: float(p + r), logits=_one_logits,
        rounds=True, tries=(3,), label="half",
    )  # fmt: skip
    monkeypatch.setitem(SCHEDULE, row.name, row)
    lay = Layout(pp=4, microbatches=8, schedule="looped_half", virtual_stages=3)
    assert schedule_class("looped_half").__name__ == "ScheduleInterleaved1F1B"
    assert (bubble_slots(lay), in_flight(lay, 1), logits_in_flight(lay)) == (0.5, 5.0, 1)
    assert schedule_text(lay) == "half x3"
    model = ModelConfig(n_layers=12)
    assert list(violations(lay, model, 64)) == []
    assert "not a multiple of pp=4 (looped_half)" in next(violations(replace(lay, microbatches=6), model, 64))
    space = Space({}, None, None, None, None, None, None, False)
    assert ("looped_half", 3) in list(_schedules(space, 4))
