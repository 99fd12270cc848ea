"""Generate: continue a prompt with a trained run's model, on the CPU (nanoGPT's `sample.py`).

The run's own record (summary.json, or .hydra/config.yaml while no summary exists) says the model, the
data and so the tokenizer (byte-level for the embedded corpus, the run's Hugging Face tokenizer for
data=text), the trained context (seq_len) and where the checkpoints are. The weights are read whole by
export's loader (any layout: TP, PP, FSDP, experts), into one eval-mode model under `torch.no_grad`.
Each new token recomputes the whole context (the last seq_len tokens): simple, and fast enough for the
models a CPU samples from.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from launcher.config.model import ModelConfig
from launcher.config.schema import CheckpointConfig, DataConfig
from launcher.errors import LauncherError
from launcher.model.init import meta_model, tied_output
from launcher.model.transformer import Transformer
from launcher.train.ckpt_pick import complete_checkpoints, no_readable, step_of
from launcher.train.export import consolidated_model_state
from launcher.train.untrusted import UnreadableCheckpoint

HELP = (
    "Continue PROMPT with the model of a train run's newest complete checkpoint (or step=STEP), on the CPU:\n"
    "prints the prompt and the new text (stdout), one line saying what sampled it (stderr)."
)
OPTIONS = "tokens=N (100), temperature=T (0.8; 0: greedy), top_k=K (200; 0: every token), seed=S (0), step=STEP, "
OPTIONS += "tokenizer=PATH|bytes (where the run does not record its own)"
EXAMPLES = """examples:
  generate runs/tiny 'def main(' tokens=200       # the newest checkpoint, temperature 0.8, top_k 200
  generate runs/tiny 'import ' temperature=0       # greedy: the same text every time
  generate runs/tiny 'class ' step=10 seed=7       # another checkpoint, another draw

docs: README.md ("Sampling from a run") in the project's repository"""
ARGUMENTS = {"run_dir": "the run_dir of a train run (summary.json, checkpoints/)", "prompt": "the text to continue"}
KEYS = "tokens=N, temperature=T, top_k=K, seed=S, step=STEP or tokenizer=PATH|bytes"


@dataclass(frozen=True)
class Settings:
    """How to sample: `temperature` 0 is greedy, `top_k` 0 keeps every token; `step` None: the newest
    readable checkpoint; `tokenizer` None: the run's own."""

    tokens: int = 100
    temperature: float = 0.8
    top_k: int = 200
    seed: int = 0
    step: int | None = None
    tokenizer: str | None = None


def number(key: str, value: str, kind: type, example: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise LauncherError(f"generate: {key}={value}: give {what}, e.g. {key}={example}") from None


# key → (type, the values it takes, an example); `step` is checked against the run's checkpoints
CHECKS: dict[str, tuple[type, Callable[[Any], bool], str, str]] = {
    "tokens": (int, lambda n: n > 0, "a positive number of tokens", "100"),
    "temperature": (float, lambda t: t >= 0, "0 (greedy) or more", "0.8"),  # NaN fails too
    "top_k": (int, lambda k: k >= 0, "0 (every token) or more", "200"),
    "seed": (int, lambda s: True, "a whole number", "0"),
    "step": (int, lambda s: True, "a whole number", "1000"),
}


def parse_options(items: list[str]) -> Settings:
    """`key=value` options of `generate`, each checked: one line naming the key and the fix."""
    found: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in Settings.__dataclass_fields__:
            raise LauncherError(f"generate: unknown option {item!r}: use {KEYS}")
        if key == "tokenizer":
            found[key] = value
            continue
        kind, ok, what, example = CHECKS[key]
        found[key] = number(key, value, kind, example)
        if not ok(found[key]):
            raise LauncherError(f"generate: {key}={value}: give {what}, e.g. {key}={example}")
    return Settings(**found)


def run_record(run_dir: Path) -> dict[str, Any]:
    """The composed config a run was trained with: summary.json's copy, else Hydra's (a run still going)."""
    if not run_dir.is_dir():
        raise LauncherError(f"generate: {run_dir}: no such folder; give the run_dir of a train run")
    summary, hydra = run_dir / "summary.json", run_dir / ".hydra" / "config.yaml"
    try:
        if summary.is_file():
            record = json.loads(summary.read_text()).get("config")
        elif hydra.is_file():
            from omegaconf import OmegaConf

            record = OmegaConf.to_container(OmegaConf.load(hydra), resolve=True)
        else:
            record = None
    except (OSError, ValueError) as err:
        raise LauncherError(f"generate: cannot read the config of {run_dir} ({err}): give another run") from None
    if not isinstance(record, dict):
        raise LauncherError(
            f"generate: {run_dir} holds no run config (summary.json or .hydra/config.yaml): give the run_dir of "
            "a train run"
        )
    return record


def section(record: dict[str, Any], key: str, schema: type, run_dir: Path) -> Any:
    """One section of the record, typed by this launcher's schema (nested sections, like moe, too)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), record.get(key) or {}))
    except OmegaConfBaseException as err:
        raise LauncherError(f"generate: the {key} config of {run_dir} does not fit this launcher ({err})") from None


def checkpoints(run_dir: Path, record: dict[str, Any], step: int | None) -> list[Path]:
    """The checkpoints to try, newest first: step `step`'s only, when given."""
    ckpt: CheckpointConfig = section(record, "checkpoint", CheckpointConfig, run_dir)
    root = Path(ckpt.dir).expanduser() if ckpt.dir else run_dir / "checkpoints"
    found = complete_checkpoints(root)
    if not found:
        raise LauncherError(
            f"generate: {run_dir} holds no complete checkpoint under {root}: train it with checkpoint.every=N"
        )
    if step is None:
        return found
    chosen = [p for p in found if step_of(p) == step]
    if not chosen:
        steps = ", ".join(str(step_of(p)) for p in reversed(found))
        raise LauncherError(
            f"generate: step={step}: {root} holds no complete checkpoint of that step: give one of {steps}"
        )
    return chosen


@torch.no_grad()
def load_model(candidates: list[Path], cfg: ModelConfig) -> tuple[Transformer, Path]:
    """The model of the newest readable checkpoint, whole, in eval mode; an unreadable one: the one before."""
    failures: list[tuple[Path, str]] = []
    for checkpoint in candidates:
        try:
            state = consolidated_model_state(checkpoint)
        except UnreadableCheckpoint as err:
            failures.append((checkpoint, str(err)))
            print(f"warning: checkpoint {checkpoint} is unreadable ({err}); trying the previous one", file=sys.stderr)
            continue
        model = meta_model(cfg)
        with tied_output(model):  # tied embeddings stay one parameter
            model.to_empty(device="cpu")
        for buffer in model.buffers():  # counters that are not checkpointed (MoE's) start at zero
            buffer.zero_()
        try:
            model.load_state_dict(state)
        except RuntimeError as err:
            first = str(err).splitlines()[1].strip() if len(str(err).splitlines()) > 1 else str(err)
            raise LauncherError(
                f"generate: {checkpoint} does not hold model '{cfg.name}' of the run's config ({first}): give "
                "the run that wrote it"
            ) from None
        model.reset_buffers()  # RoPE's tables, on the CPU
        return model.eval(), checkpoint
    raise no_readable(candidates[0].parent, failures, "generate: give another run, or train this one on to save one")


@dataclass(frozen=True)
class Codec:
    """Text to token ids and back; `start`: the ids a document starts after (as training packed them)."""

    name: str
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    vocab: int
    start: tuple[int, ...] = ()


BYTES = Codec("byte-level", lambda text: list(text.encode()), lambda ids: bytes(ids).decode(errors="replace"), 256)


def hf_codec(path: str) -> Codec:
    """The Hugging Face tokenizer at `path` (the loader data=text uses); documents started after EOS, BOS."""
    from launcher.config.extras import require
    from launcher.data.tokenizer import load

    require("tokenizers", what="generate with a Hugging Face tokenizer")
    tok = load(path)
    start = (tok.eos_id,) if tok.bos_id is None else (tok.eos_id, tok.bos_id)
    return Codec(path, lambda text: tok.encode([text])[0], tok.backend.decode, tok.vocab_size, start)


def codec_for(data: DataConfig, override: str | None) -> Codec:
    """The tokenizer the run's tokens were made with, or `override` (a path, or `bytes`)."""
    if override:
        return BYTES if override == "bytes" else hf_codec(override)
    sources = [{**vars(data), **s} for s in data.sources] if data.name == "mix" else [vars(data)]
    kinds = {s["name"] for s in sources}
    tokenizers = {s["tokenizer"] for s in sources if s["name"] == "text" and s["tokenizer"]}
    if kinds == {"stdlib"}:
        return BYTES
    if kinds <= {"stdlib", "text"} and len(tokenizers) == 1:
        return hf_codec(tokenizers.pop())
    raise LauncherError(
        f"generate: the run trained on data={data.name}, whose tokenizer it does not record: give tokenizer=PATH "
        "(the tokenizer.json its tokens were made with) or tokenizer=bytes"
    )


def pick(logits: torch.Tensor, settings: Settings, generator: torch.Generator) -> int:
    """The next token from the last position's logits: the most likely at temperature 0, else a draw
    from the `top_k` most likely, their probabilities sharpened or flattened by the temperature."""
    if settings.temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / settings.temperature
    if 0 < settings.top_k < logits.numel():
        logits = logits.masked_fill(logits < torch.topk(logits, settings.top_k).values[-1], float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


def sample(model: Transformer, ids: list[int], settings: Settings, context: int, vocab: int) -> Iterator[int]:
    """`settings.tokens` new token ids after `ids`, each from the last `context` tokens (full recompute);
    only ids below `vocab` (the tokenizer's) are drawn. The same seed gives the same tokens."""
    generator = torch.Generator().manual_seed(settings.seed)
    ids = list(ids)
    with torch.no_grad():
        for _ in range(settings.tokens):
            logits = model(torch.tensor([ids[-context:]]))[0, -1, :vocab]
            ids.append(pick(logits, settings, generator))
            yield ids[-1]


def write_stream(tokens: Iterator[int], decode: Callable[[list[int]], str], out: Any) -> list[int]:
    """Print the text of `tokens` as they come (a partial UTF-8 character waits for its last byte)."""
    new: list[int] = []
    shown = ""
    for token in tokens:
        new.append(token)
        text = decode(new)
        if text.startswith(shown) and not text.endswith("\ufffd"):
            out.write(text[len(shown) :])
            out.flush()
            shown = text
    text = decode(new)
    out.write((text[len(shown) :] if text.startswith(shown) else "") + "\n")
    return new


def generate(run_dir: str, prompt: str, items: list[str], out: Any = None) -> list[int]:
    """Print `prompt` and its continuation by the run's model; the new token ids. Every check (options,
    run, checkpoint, tokenizer, prompt) comes before the weights are read."""
    settings = parse_options(items)
    if not prompt:
        raise LauncherError("generate: the prompt is empty: give some text to continue, e.g. 'def main('")
    path = Path(run_dir).expanduser()
    record = run_record(path)
    model_cfg: ModelConfig = section(record, "model", ModelConfig, path)
    candidates = checkpoints(path, record, settings.step)
    codec = codec_for(section(record, "data", DataConfig, path), settings.tokenizer)
    ids = [*codec.start, *codec.encode(prompt)]
    context = min(int(record.get("seq_len") or model_cfg.max_seq_len), model_cfg.max_seq_len)
    model, checkpoint = load_model(candidates, model_cfg)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"generate: {settings.tokens:,} tokens from step {step_of(checkpoint):,} of {path} (model {model_cfg.name}, "
        f"{params:,} parameters; {codec.name} tokenizer; context {context:,}; temperature {settings.temperature:g}, "
        f"top_k {settings.top_k}, seed {settings.seed})",
        file=sys.stderr,
    )
    out = out or sys.stdout
    out.write(prompt)
    tokens = sample(model, ids, settings, context, min(codec.vocab, model_cfg.vocab_size))
    return write_stream(tokens, codec.decode, out)
