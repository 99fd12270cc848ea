"""data=mix: the schedule's shares, exact resume and resharding, phases, skipped batches, bad input,
and per-source losses equal to those computed on each source's sequences alone (tp=1, tp=2, pp=2)."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from launcher.config.mix import mixture_sources
from launcher.config.model import ModelConfig
from launcher.config.schema import DataConfig, TrainConfig
from launcher.config.validate import validate
from launcher.data.corpus import Splits
from launcher.data.mix import MixLoader, Mixture, Schedule, check_mix, mix_loader
from launcher.errors import LauncherError
from tests.conftest import make_config
from tests.dist import run_many

ODD = [Fraction(47, 100), Fraction(31, 100), Fraction(22, 100)]


def counts(schedule: Schedule, n: int) -> np.ndarray:
    return schedule.before[n] if n < len(schedule.table) else schedule.consumed(n)


@pytest.mark.parametrize("fractions", [ODD, [Fraction(5, 9), Fraction(3, 9), Fraction(1, 9)], [Fraction(1, 3)] * 3])
def test_every_source_keeps_its_share_over_every_window(fractions: list[Fraction]) -> None:
    """After any n sequences of a phase each source is within one sequence of n x share; over any
    window (of sequences, so of steps of any global batch) within two, which is the best a schedule
    can do for three unequal shares (module docstring)."""
    schedule = Schedule.build(fractions, seed=5)
    n = 3 * len(schedule.table) + 17
    seen = np.zeros((n + 1, 3), dtype=np.int64)
    source, _ = schedule.at(np.arange(n))
    np.cumsum(np.eye(3, dtype=np.int64)[source], axis=0, out=seen[1:])
    share = np.array([float(f) for f in fractions])
    prefix = seen - np.arange(n + 1)[:, None] * share
    assert np.abs(prefix).max() < 1  # every prefix of the phase
    assert np.array_equal(seen[-1], schedule.consumed(n))  # the closed form agrees with counting
    for batch in (1, 4, 7, 24):  # windows of whole steps, every start and length
        steps = seen[::batch]
        windows = steps[None, :, :] - steps[:, None, :]
        length = (np.arange(len(steps))[None, :] - np.arange(len(steps))[:, None]) * batch
        assert np.abs(windows - length[..., None] * share).max() < 2


def mixture(sizes: tuple[int, ...] = (4000, 3000, 2000), fractions: list[Fraction] = ODD) -> Mixture:
    parts = [np.arange(n, dtype=np.uint16) + 10_000 * i for i, n in enumerate(sizes)]  # a token tells its source
    return Mixture(["a", "b", "c"], fractions, [Splits(p, p[:100], 4000) for p in parts])


def served(loader: MixLoader, steps: int) -> list[tuple[torch.Tensor, np.ndarray]]:
    return [(loader.next_batch()[0], loader.sources.copy()) for _ in range(steps)]


def test_resume_reshards_from_one_rank_to_two_and_counts_every_sequence() -> None:
    mix = mixture()
    run = mix_loader(mix, "train", 16, 12, seed=3)
    first = served(run, 5)
    state = run.state_dict()
    expected = served(run, 5)
    resumed = [mix_loader(mix, "train", 16, 12, seed=3, dp_rank=r, dp_size=2) for r in range(2)]
    for loader in resumed:
        loader.load_state_dict(state)
    for inputs, sources in expected:
        ranks = [served(loader, 1)[0] for loader in resumed]
        assert torch.equal(torch.cat([x for x, _ in ranks]), inputs)
        assert np.array_equal(np.concatenate([s for _, s in ranks]), sources)
    rows = [x for x, _ in first + expected]
    assert all(int(row[0]) // 10_000 == s for x, sources in first + expected for row, s in zip(x, sources))
    # every source's k-th sequence once: its count of the 120 served, each drawn from its own stream
    per_source = np.bincount(np.concatenate([s for _, s in first + expected]), minlength=3)
    assert per_source.tolist() == resumed[0].consumed() == [56, 37, 27]  # 120 x (0.47, 0.31, 0.22) within one
    assert len({tuple(r.tolist()) for x in rows for r in x}) == 120  # no sequence twice


def test_new_weights_on_resume_begin_a_phase_and_carry_the_counts() -> None:
    run = mix_loader(mixture(), "train", 16, 10, seed=1)
    served(run, 3)
    state = run.state_dict()
    assert state["mix"] == {"labels": ["a", "b", "c"], "weights": ["47/100", "31/100", "11/50"], "start": 0,
                            "consumed_at_start": [0, 0, 0]}  # fmt: skip
    same = mix_loader(mixture(), "train", 16, 10, seed=1)
    same.load_state_dict(state)
    assert same.note is None and same.phase_start == 0
    changed = mix_loader(mixture(fractions=[Fraction(1, 10), Fraction(1, 10), Fraction(8, 10)]), "train", 16, 10, 1)
    changed.load_state_dict(state)
    assert changed.phase_start == 30 and changed.base == run.consumed() == [14, 9, 7]
    assert changed.note and "new mixture phase at sample 30" in changed.note and "a 0.47->0.1" in changed.note
    second = served(changed, 5)
    assert np.bincount(np.concatenate([s for _, s in second]), minlength=3).tolist() == [5, 5, 40]
    source, index = changed.schedule.at(np.arange(50))  # each source's stream goes on where it stopped
    assert sorted(index[source == 2] + 7) == list(range(7, 47))
    again = mix_loader(mixture(fractions=changed.fractions), "train", 16, 10, 1)
    again.load_state_dict(changed.state_dict())  # the new phase's state: resumed in that phase
    assert again.phase_start == 30 and again.base == [14, 9, 7] and again.note is None


def test_skipped_batches_are_never_served_in_a_mixture() -> None:
    plain, skipping = (mix_loader(mixture(), "train", 8, 6, seed=2) for _ in range(2))
    skipping.skipped = [[2, 3]]
    batches = served(plain, 4)
    assert torch.equal(served(skipping, 1)[0][0], batches[0][0])
    assert torch.equal(served(skipping, 1)[0][0], batches[3][0]) and skipping.batch_number == 4


@pytest.mark.parametrize(
    ("sources", "expected"),
    [
        ("[]", "data=mix has no data.sources"),
        ("[{name: stdlib, weight: 0}]", "data.sources[0].weight=0: give a number > 0"),
        ("[{name: stdlib, weight: -1}]", "data.sources[0].weight=-1: give a number > 0"),
        ("[{name: stdlib, weight: heavy}]", "data.sources[0].weight=heavy: give a number > 0"),
        ("[{name: stdlib}]", "data.sources[0].weight=None: give a number > 0"),
        ("[{name: stdlib, weight: 1}, {name: mix, weight: 1}]", "data.sources[1].name=mix: a mixture cannot nest"),
        ("[{name: stdlib, weight: 1, colour: red}]", "data.sources[0]: unknown key colour"),
        ("[{name: stdlib, weight: 0.3333333}, {name: stdlib, weight: 1}]", "repeat only every"),
    ],
)
def test_bad_mixtures_are_one_line_before_spawn(sources: str, expected: str) -> None:
    with pytest.raises(LauncherError, match=expected.replace("[", r"\[").replace("]", r"\]")) as err:
        validate(make_config("data=mix", f"data.sources={sources}"))
    assert "\n" not in str(err.value)


def test_a_source_too_small_or_of_another_vocabulary_is_one_line(tmp_path: Path) -> None:
    short, fine = tmp_path / "short.bin", tmp_path / "fine.bin"
    np.arange(20, dtype=np.uint16).tofile(short)
    np.arange(5000, dtype=np.uint16).tofile(fine)
    base = DataConfig(name="mix", cache_dir=str(tmp_path), max_bytes=50_000)
    small = replace(base, sources=[{"name": "tokens", "path": str(fine), "weight": 2},
                                   {"name": "tokens", "path": str(short), "weight": 1, "label": "tiny"}])  # fmt: skip
    with pytest.raises(LauncherError, match=r"data.sources\[1\] \(tiny\): data.path=.*short.bin: 19 training tokens"):
        check_mix(small, 8000, 32, evaluates=False)
    text = {"name": "text", "path": "x.jsonl", "tokenizer": "tok.json", "weight": 1}
    other = replace(base, sources=[{"name": "stdlib", "weight": 1}, text])
    with pytest.raises(
        LauncherError, match=r"data.sources\[0\] \(stdlib\) and data.sources\[1\] \(text\) use different"
    ):
        check_mix(other, 8000, 32, evaluates=False)
    check_mix(replace(small, sources=small.sources[:1]), 8000, 32, evaluates=True)
    assert [s.label for s in mixture_sources(replace(base, sources=[{"name": "stdlib", "weight": 1}] * 2))] == [
        "stdlib0",
        "stdlib1",
    ]


VOCAB, SEQ = 128, 16
IDS = torch.tensor([0, 2, 1, 0, 0, 2, 1, 0])  # the source of each of the batch's 8 sequences


def per_source_case(rank: int, world_size: int, keys: dict) -> dict[str, torch.Tensor]:
    """Per-source sums from the runner of `keys`'s layout (a training pass, then an evaluation) and,
    on one process, each source's loss from the model on its sequences alone."""
    from launcher.config.layout_keys import from_config
    from launcher.layout import build_mesh
    from launcher.ops.loss import token_losses
    from launcher.parallel import build_runner
    from launcher.planner import build_options

    model = ModelConfig(name="t", dim=32, n_layers=2, n_heads=4, ffn_dim=64, vocab_size=VOCAB, max_seq_len=SEQ)
    cfg = replace(TrainConfig(model=model, seq_len=SEQ, seed=3, batch={"micro": 4, "global": 8}), **keys)
    layout = from_config(cfg, world_size)
    mesh = build_mesh(layout, "cpu") if world_size > 1 else None
    runner = build_runner(cfg.model, layout, mesh, build_options(cfg, layout), torch.device("cpu"))
    tokens = torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(9))
    x, y = tokens[:, :-1], tokens[:, 1:]
    out = {}
    with token_losses() as recorded:
        out["loss"] = torch.tensor(runner.forward_backward(x, y))
    out["train"] = runner.source_sums(recorded, IDS, 3)
    with token_losses() as recorded:
        runner.evaluate(x, y)
    out["eval"] = runner.source_sums(recorded, IDS, 3)
    if world_size == 1:
        with torch.no_grad():
            out["alone"] = torch.stack([runner.model(x[IDS == s], y[IDS == s]).double() for s in range(3)])
    return out


@pytest.mark.slow
def test_per_source_loss_equals_each_sources_own_loss() -> None:
    ref, tp2, pp2 = (
        results[0] if len(results) == 1 else results[-1]
        for results in run_many(
            [(per_source_case, 1, ({},)), (per_source_case, 2, ({"tp": 2},)), (per_source_case, 2, ({"pp": 2},))]
        )  # fmt: skip
    )
    tokens = torch.bincount(IDS, minlength=3).double() * SEQ
    for case in (ref, tp2, pp2):
        for key in ("train", "eval"):
            assert torch.equal(case[key][:, 1], tokens), (case is ref, case is tp2, key)
            torch.testing.assert_close(case[key][:, 0] / tokens, ref["alone"], rtol=1e-5, atol=1e-6)
        # the sums make the step's mean loss: nothing counted twice or left out
        assert float(case["train"][:, 0].sum() / tokens.sum()) == pytest.approx(float(case["loss"]), rel=1e-6)
