"""`generate`: a run's checkpoint continues a prompt, on the CPU. The continuation comes from the trained
weights (the same logits as the checkpoint loaded by hand), has the requested number of tokens, is the
same for a seed and at temperature 0, and reads only the trained context; the run's tokenizer (bytes or
data=text's) round-trips; bad input is one line, exit 2."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch

from launcher.config.schema import DataConfig
from launcher.errors import LauncherError
from launcher.model import Transformer
from launcher.train.ckpt_pick import complete_checkpoints
from launcher.train.export import consolidated_model_state
from launcher.train.generate import BYTES, Settings, codec_for, parse_options, pick, write_stream
from launcher.train.generate import generate as generate_ids
from launcher.train.loop import train
from tests.conftest import assert_bad_input, run_cli, run_for, tiny_config

PROMPT = "def main("


def trained(root: Path, name: str, *keys: str) -> Path:
    """A tiny run of 4 steps with checkpoints at steps 2 and 4, under root/name."""
    cfg = tiny_config(root, "steps=4", "checkpoint.every=2", *keys)
    train(run_for(cfg), root / name)
    return root / name


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return trained(tmp_path_factory.mktemp("generate"), "run")


def generate(run_dir: Path, prompt: str = PROMPT, *options: str) -> tuple[list[int], str]:
    out = io.StringIO()
    return generate_ids(str(run_dir), prompt, list(options), out), out.getvalue()


def expected_logits(run_dir: Path, cfg_keys: tuple[str, ...], ids: list[int], step: int | None = None) -> torch.Tensor:
    """The last position's logits of the checkpoint's weights in a model built the plain way."""
    cfg = tiny_config(run_dir.parent, *cfg_keys)
    checkpoint = [p for p in complete_checkpoints(run_dir / "checkpoints") if step in (None, int(p.name[5:]))][0]
    model = Transformer(cfg.model).eval()
    model.load_state_dict(consolidated_model_state(checkpoint))
    with torch.no_grad():
        return model(torch.tensor([ids[-cfg.seq_len :]]))[0, -1]


@pytest.mark.parametrize(
    ("items", "expected"),
    [
        (["tokens=0"], "generate: tokens=0: give a positive number of tokens, e.g. tokens=100"),
        (["temperature=-0.5"], "generate: temperature=-0.5: give 0 (greedy) or more, e.g. temperature=0.8"),
        (["temperature=nan"], "generate: temperature=nan: give 0 (greedy) or more"),
        (["top_k=-1"], "generate: top_k=-1: give 0 (every token) or more, e.g. top_k=200"),
        (["tokens=ten"], "generate: tokens=ten: give a whole number, e.g. tokens=100"),
        (["--tokens=5"], "generate: unknown option '--tokens=5': use tokens=N, temperature=T"),
        (["steps=5"], "generate: unknown option 'steps=5'"),
    ],
)
def test_bad_options_are_one_line(items: list[str], expected: str) -> None:
    with pytest.raises(LauncherError) as err:
        parse_options(items)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_options_and_their_defaults() -> None:
    assert parse_options([]) == Settings(tokens=100, temperature=0.8, top_k=200, seed=0)
    assert parse_options(["tokens=5", "temperature=0", "top_k=0", "seed=3", "step=2", "tokenizer=bytes"]) == Settings(
        5, 0.0, 0, 3, 2, "bytes"
    )


def test_pick_is_greedy_at_zero_and_draws_only_the_top_k() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])
    gen = torch.Generator().manual_seed(0)
    assert pick(logits, Settings(temperature=0), gen) == 1
    assert {pick(logits, Settings(temperature=5.0, top_k=2), gen) for _ in range(200)} == {1, 3}
    assert len({pick(logits, Settings(temperature=5.0, top_k=0), gen) for _ in range(200)}) == 5


def test_the_runs_tokenizer_and_a_character_split_over_tokens() -> None:
    assert codec_for(DataConfig(), None) is BYTES and codec_for(DataConfig(name="tokens"), "bytes") is BYTES
    with pytest.raises(LauncherError, match="trained on data=tokens, whose tokenizer it does not record: give"):
        codec_for(DataConfig(name="tokens", path="train.bin"), None)
    out = io.StringIO()
    assert write_stream(iter("é ok".encode()), BYTES.decode, out) == list("é ok".encode())
    assert out.getvalue() == "é ok\n"


@pytest.mark.slow
def test_greedy_continues_the_prompt_with_the_checkpoints_model(run: Path) -> None:
    ids, text = generate(run, PROMPT, "tokens=12", "temperature=0")
    assert len(ids) == 12 and text == PROMPT + BYTES.decode(ids) + "\n"
    assert generate(run, PROMPT, "tokens=12", "temperature=0") == (ids, text)
    prompt = list(PROMPT.encode())
    assert ids[0] == int(expected_logits(run, (), prompt).argmax())
    assert ids[5] == int(expected_logits(run, (), prompt + ids[:5]).argmax())
    older, _ = generate(run, PROMPT, "tokens=12", "temperature=0", "step=2")
    assert older[0] == int(expected_logits(run, (), prompt, step=2).argmax())
    assert generate(run, PROMPT, "tokens=12", "temperature=0", "step=4")[0] == ids


@pytest.mark.slow
def test_a_seed_gives_the_same_draw(run: Path) -> None:
    first = generate(run, PROMPT, "tokens=40", "seed=5", "temperature=1.5")
    assert len(first[0]) == 40 and first == generate(run, PROMPT, "tokens=40", "seed=5", "temperature=1.5")
    assert first[0] != generate(run, PROMPT, "tokens=40", "seed=6", "temperature=1.5")[0]


@pytest.mark.slow
def test_only_the_trained_context_is_read(run: Path) -> None:
    """seq_len=32: a prompt longer than the model's 256 positions works, and what lies more than 32
    tokens back changes nothing."""
    tail = "x" * 40
    ids, text = generate(run, "a" * 300 + tail, "tokens=6", "temperature=0")
    assert ids == generate(run, "b" * 300 + tail, "tokens=6", "temperature=0")[0]
    assert text.startswith("a" * 300 + tail)


@pytest.mark.slow
@pytest.mark.parametrize(
    "keys", [("model.tied_embeddings=true",), ("model=moe_tiny",), ("model.positions=learned",)], ids=str
)
def test_every_model_kind_loads_its_trained_weights(tmp_path: Path, keys: tuple[str, ...]) -> None:
    run_dir = trained(tmp_path, "r", *keys)
    ids, _ = generate(run_dir, PROMPT, "tokens=3", "temperature=0")
    assert ids[0] == int(expected_logits(run_dir, keys, list(PROMPT.encode())).argmax())


@pytest.mark.slow
def test_an_unreadable_newest_checkpoint_falls_back(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (shard,) = (copy / "checkpoints" / "step_00000004").glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:100])
    ids, _ = generate(copy, PROMPT, "tokens=12", "temperature=0")
    assert ids == generate(run, PROMPT, "tokens=12", "temperature=0", "step=2")[0]
    err = capsys.readouterr().err
    assert "step_00000004 is unreadable" in err and f"12 tokens from step 2 of {copy}" in err


@pytest.mark.slow
def test_data_text_runs_use_their_tokenizer(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    from launcher.data.tokenizer import load
    from tests.textdata import train_bpe, write_corpus

    train_bpe(tmp_path / "tokenizer.json", 512)
    write_corpus(tmp_path / "corpus", max_chars=100_000, kinds=("jsonl",))
    keys = ("data=text", f"data.path={tmp_path / 'corpus'}/*", f"data.tokenizer={tmp_path / 'tokenizer.json'}")
    run_dir = trained(tmp_path, "text", *keys, "model.vocab_size=512")
    ids, text = generate(run_dir, PROMPT, "tokens=20", "temperature=0")
    tokenizer = load(str(tmp_path / "tokenizer.json"))
    assert len(ids) == 20 and max(ids) < 512
    assert text == PROMPT + tokenizer.backend.decode(ids) + "\n"
    codec = codec_for(DataConfig(name="text", tokenizer=str(tmp_path / "tokenizer.json")), None)
    assert codec.start == (tokenizer.eos_id,) and tokenizer.bos_id is None  # a document starts after one ends
    start = [tokenizer.eos_id, *tokenizer.encode([PROMPT])[0]]
    cfg_keys = (*keys, "model.vocab_size=512")
    assert ids[0] == int(expected_logits(run_dir, cfg_keys, start).argmax())


@pytest.mark.slow
def test_the_cli_prints_the_prompt_and_its_continuation(run: Path) -> None:
    result = run_cli("generate", str(run), PROMPT, "tokens=16", "temperature=0")
    assert result.returncode == 0, result.stderr
    ids, text = generate(run, PROMPT, "tokens=16", "temperature=0")
    assert result.stdout == text
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"generate: 16 tokens from step 4 of {run} (model tiny, 125,248 parameters; byte-level")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["missing", PROMPT], "generate: {tmp}/missing: no such folder; give the run_dir of a train run"),
        (["empty", PROMPT], "generate: {tmp}/empty holds no run config (summary.json or .hydra/config.yaml)"),
        (["unsaved", PROMPT], "generate: {tmp}/unsaved holds no complete checkpoint under {tmp}/unsaved/checkpoints"),
        (["RUN", PROMPT, "step=3"], "generate: step=3: {run}/checkpoints holds no complete checkpoint of that step"),
        (["RUN", PROMPT, "tokens=0"], "generate: tokens=0: give a positive number of tokens"),
        (["RUN", PROMPT, "temperature=-1"], "generate: temperature=-1: give 0 (greedy) or more"),
        (["RUN", ""], "generate: the prompt is empty"),
    ],
    ids=lambda v: v if isinstance(v, str) else " ".join([v[0], *v[2:]]),
)
def test_bad_input_is_one_line_exit_2(run: Path, tmp_path: Path, args: list[str], expected: str) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "unsaved").mkdir()
    shutil.copy(run / "summary.json", tmp_path / "unsaved" / "summary.json")
    folder = run if args[0] == "RUN" else tmp_path / args[0]
    result = run_cli("generate", str(folder), *args[1:])
    assert_bad_input(result, expected.format(tmp=tmp_path, run=run), tmp_path)
