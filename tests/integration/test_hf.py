"""Hugging Face Llama folders both ways: `export format=hf` loads in transformers with our logits,
`init.from` starts from a folder transformers wrote (one process, tp=2 and pp=2 alike), and a folder
that does not fit the model is one line before any worker starts."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from launcher.config.schema import TrainConfig
from launcher.errors import LauncherError
from launcher.launch.spawn import start_local_workers
from launcher.model import Transformer
from launcher.model.hf import check_folder, hf_name, load_weights
from launcher.model.init import materialize, meta_model
from launcher.train.ckpt_pick import complete_checkpoints
from launcher.train.export import consolidated_model_state, export, shard_groups
from launcher.train.loop import train
from launcher.train.setup import build
from tests.conftest import assert_bad_input, losses, run_cli, run_for, tiny_args, tiny_config
from tests.dist import run

transformers = pytest.importorskip("transformers")  # the [hf] extra; `make setup` installs it
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))


def hf_logits(folder: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def our_logits(cfg: TrainConfig, state: dict[str, torch.Tensor]) -> torch.Tensor:
    model = Transformer(cfg.model).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        return model(TOKENS)


def newest(run: Path) -> Path:
    return complete_checkpoints(run / "checkpoints")[0]


def hf_folder(path: Path, seed: int = 11, **overrides: object) -> Path:
    """A Llama folder as transformers writes it, of `tiny`'s shapes, every weight random (norms too)."""
    tiny = dict(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
    )  # fmt: skip
    config = transformers.LlamaConfig(**(tiny | overrides))
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path, max_shard_size="100KB")  # several shards and an index, as large models have
    return path


def test_hf_names_cover_every_parameter() -> None:
    names = {hf_name(n) for n, _ in meta_model(tiny_config(Path("/unused")).model).named_parameters()}
    assert "model.layers.1.self_attn.k_proj.weight" in names and "lm_head.weight" in names
    assert len(names) == 2 + 9 * 2 + 1


def test_shard_groups_bound_each_shard() -> None:
    assert shard_groups({"a": 4, "b": 4, "c": 9, "d": 1}, 8) == [["a", "b"], ["c"], ["d"]]


# tied embeddings; a head_dim apart from dim // n_heads (Qwen3-style: 4 heads of 32 in a 64-wide model),
# which config.json must carry for transformers to build projections of our widths
@pytest.mark.slow
@pytest.mark.parametrize(
    "keys", [(), ("model.tied_embeddings=true",), ("model.head_dim=32",)], ids=["untied", "tied", "head_dim"]
)
def test_exported_tiny_loads_in_transformers_with_our_logits(tmp_path: Path, keys: tuple[str, ...]) -> None:
    cfg = tiny_config(tmp_path, "steps=2", "checkpoint.every=2", *keys)
    train(run_for(cfg), tmp_path / "r")
    out = tmp_path / "hf"
    result = run_cli("export-weights", str(tmp_path / "r" / "checkpoints"), str(out), "format=hf", "shard_gib=0.0001")
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    assert {(out / f).stat().st_mode & 0o777 for f in index["weight_map"].values()} == {0o644}  # umask 022 here
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    expected = our_logits(cfg, consolidated_model_state(newest(tmp_path / "r")))
    torch.testing.assert_close(hf_logits(out), expected, rtol=0, atol=1e-5)


def read_on_every_layout(rank: int, world_size: int, folder: Path, cases: list[dict]) -> list[dict]:
    """Each case's parameters after the rank's build with init.from (`parallelize`, then the folder's
    weights read into the shards), gathered whole (names → tensors)."""
    out = []
    for keys in cases:
        cfg = replace(tiny_config(Path("/unused"), f"init.from={folder}"), **keys)
        runner = build(run_for(cfg, world_size), rank, torch.device("cpu"))
        params = {n: p for part in runner.parts for n, p in part.named_parameters()}
        out.append({n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in params.items()})
    return out


@pytest.mark.slow
def test_every_layout_reads_exactly_the_folders_tensors(tmp_path: Path) -> None:
    """tp=2 (rows and columns), FSDP (rows of row-sharded tensors), pp=2 (each stage its layers): each
    rank reads its own box, and the boxes together are the folder's tensors, bit for bit."""
    from safetensors.torch import load_file

    folder = hf_folder(tmp_path / "llama")
    cases = [dict(tp=2), dict(dp=2, dp_shard=2), dict(pp=2)]
    per_rank = run(read_on_every_layout, 2, folder, cases)
    theirs = {}
    for file in folder.glob("*.safetensors"):
        theirs |= load_file(file)
    for c, case in enumerate(cases):
        held = {n: t for rank in per_rank for n, t in rank[c].items()}
        assert len(held) == 2 + 9 * 2 + 1, case
        for name, tensor in held.items():
            assert torch.equal(tensor, theirs[hf_name(name)]), (case, name)


@pytest.mark.slow
def test_import_gives_transformers_logits_then_trains_under_tp2_as_one_process(tmp_path: Path) -> None:
    """The folder's weights load unchanged (step 0 logits = HF's), and training from them under tp=2
    (local workers, each rank reading its own shards) matches one process; the tp=2 result exported
    again loads in transformers with our logits."""
    folder = hf_folder(tmp_path / "llama")
    overrides = ("hardware.peak_tflops=1.0", "steps=5", "checkpoint.every=5", f"init.from={folder}")
    model = meta_model(tiny_config(tmp_path).model)
    materialize([model], 0, torch.device("cpu"), draw=False)
    load_weights([model], str(folder))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(TOKENS), hf_logits(folder), rtol=0, atol=1e-5)

    ref = tiny_config(tmp_path, *overrides)
    train(run_for(ref), tmp_path / "single")
    cfg = tiny_config(tmp_path, *overrides, "tp=2", "threads=1")
    start_local_workers(run_for(cfg, None), tmp_path / "tp2")
    expected = losses(tmp_path / "single")
    assert losses(tmp_path / "tp2") == pytest.approx(expected, rel=1e-4)
    assert losses(tmp_path / "tp2")[1] < 10  # started from the folder, not from NaN or a random model

    out = export(str(tmp_path / "tp2" / "checkpoints"), str(tmp_path / "back"), "hf")
    expected_logits = our_logits(cfg, consolidated_model_state(newest(tmp_path / "tp2")))
    torch.testing.assert_close(hf_logits(out), expected_logits, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_pp2_checkpoint_exports_and_imports_back(tmp_path: Path) -> None:
    """Trained under pp=2, exported as HF (same logits in transformers), imported under pp=2: the first
    step's loss is the loss of the exported model."""
    common = [*tiny_args(tmp_path / "cache", steps=2), "batch.global=8", "hardware.peak_tflops=1.0"]
    args = [*common, "pp=2", "checkpoint.every=2"]
    result = run_cli("train", *args, f"run_dir={tmp_path / 'pp2'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "hf"
    assert run_cli("export-weights", str(tmp_path / "pp2" / "checkpoints"), str(out), "format=hf").returncode == 0
    cfg = tiny_config(tmp_path)
    torch.testing.assert_close(
        hf_logits(out), our_logits(cfg, consolidated_model_state(newest(tmp_path / "pp2"))), rtol=0, atol=1e-5
    )
    back = (f"init.from={out}", f"run_dir={tmp_path / 'back'}", "metrics.console=plain")
    again = run_cli("train", *args, "steps=1", *back, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"initial weights from {out} (init.from), not seeded random" in again.stdout
    one = run_cli("train", *common, "steps=1", f"init.from={out}", f"run_dir={tmp_path / 'one'}", cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    assert losses(tmp_path / "back")[1] == pytest.approx(losses(tmp_path / "one")[1], rel=1e-4)


@pytest.mark.slow
def test_a_folder_of_other_shapes_is_one_line_before_spawn(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path / "wide", intermediate_size=128)
    result = run_cli("train", *tiny_args(tmp_path / "cache"), "tp=2", f"init.from={folder}", cwd=tmp_path)
    assert_bad_input(result, "model.layers.0.mlp.gate_proj.weight with shape (128, 64)", tmp_path)
    result = run_cli("train", *tiny_args(tmp_path / "cache"), f"init.from={tmp_path / 'none'}", cwd=tmp_path)
    assert_bad_input(result, f"init.from={tmp_path / 'none'}: cannot read it", tmp_path)
    other_theta = hf_folder(tmp_path / "theta", rope_theta=500000.0)
    result = run_cli("train", *tiny_args(tmp_path / "cache"), f"init.from={other_theta}", cwd=tmp_path)
    assert_bad_input(result, "rope_theta=500000.0 but model.rope_theta=10000.0", tmp_path)


def test_damaged_or_rescaled_folders_are_one_line(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path / "llama")
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.write_bytes(b"\xff" * 64)
    with pytest.raises(LauncherError, match=f"cannot read .* from {shard.name}"):
        check_folder(tiny_config(tmp_path).model, str(folder))
    scaled = hf_folder(tmp_path / "scaled")
    config = json.loads((scaled / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}
    (scaled / "config.json").write_text(json.dumps(config))
    with pytest.raises(LauncherError, match="rope_type=llama3"):
        check_folder(tiny_config(tmp_path).model, str(scaled))


@pytest.mark.slow
def test_export_format_hf_refuses_a_non_llama_model(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "steps=1", "checkpoint.every=1", "model.mlp=gelu")
    train(run_for(cfg), tmp_path / "r")
    result = run_cli("export-weights", str(tmp_path / "r" / "checkpoints"), str(tmp_path / "hf"), "format=hf")
    assert result.returncode == 2 and "model.mlp=gelu (Llama: swiglu)" in result.stderr, result.stderr
    assert not (tmp_path / "hf").exists()
