"""Hugging Face Llama folders both ways: our parameter names and config beside HF's, and each rank's
piece of a parameter read straight from the folder's safetensors shards.

RoPE needs no conversion: `pointwise.rotate` turns the two halves of a head (dims i and i + head_dim/2
share an angle) with tables that repeat the frequencies (`cat(f, f)`), exactly as HF's `rotate_half`
does, so q and k weights keep their row order. (Meta's original checkpoints pair adjacent dims; HF's
own converter permutes those rows into this layout once.) tests/integration/test_hf.py checks the logits.

Reading (`init.from=PATH`): a rank reads only the boxes of the parameters it holds, `safe_open`'s
slices over the memory-mapped shard, so no rank materializes the whole model. Torch is imported
inside the functions that need it: `check_folder` runs in the launcher before any worker starts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.config.extras import require
from launcher.config.model import ModelConfig
from launcher.errors import LauncherError
from launcher.flops import head_dim

if TYPE_CHECKING:
    import torch

CONFIG, INDEX, SINGLE = "config.json", "model.safetensors.index.json", "model.safetensors"
TOP = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
LAYER = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}
PARAM = re.compile(r"(?:layers\.(\d+)\.)?(.+)\.(weight|bias)")


def hf_name(name: str) -> str:
    """Our parameter name → HF's (`layers.3.attention.wq.weight` → `model.layers.3.self_attn.q_proj.weight`)."""
    match = PARAM.fullmatch(name)
    layer, module, kind = match.groups() if match else (None, "", "")
    hf = LAYER.get(module) if layer is not None else TOP.get(module)
    if hf is None:
        raise KeyError(f"{name} has no Hugging Face Llama counterpart")
    return f"model.layers.{layer}.{hf}.{kind}" if layer is not None else f"{hf}.{kind}"


def check_llama(cfg: ModelConfig, key: str) -> None:
    """Only the Llama family has an HF counterpart here: one line naming the first key that differs."""
    if cfg.moe.experts:
        raise LauncherError(
            f"{key} needs a dense Llama-style model, but model.moe.experts={cfg.moe.experts}: a mixture of experts "
            "has no Hugging Face Llama counterpart (export-weights' default format=safetensors writes any model)"
        )
    llama = {"norm": "rmsnorm", "norm_position": "pre", "mlp": "swiglu", "positions": "rope"}
    for field, value in llama.items():
        if getattr(cfg, field) != value:
            raise LauncherError(
                f"{key} needs a Llama-style model, but model.{field}={getattr(cfg, field)} "
                f"(Llama: {value}): use a Llama model (tiny, small, 125m, 1b, 8b, 70b, 405b)"
            )


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json of a LlamaForCausalLM with `cfg`'s architecture (fp32 weights). rope_theta is written
    both ways transformers has read it (top level before v5, `rope_parameters` since)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
        "head_dim": head_dim(cfg),
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tied_embeddings,
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        "hidden_act": "silu",
        "initializer_range": cfg.init_std,
        "torch_dtype": "float32",
    }


def rope_theta(hf: dict[str, Any]) -> float:
    return float((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))


# the config.json keys read here, and the JSON types each must have
CONFIG_TYPES: dict[str, tuple[type, ...]] = {
    "rms_norm_eps": (int, float),
    "rope_theta": (int, float),
    "tie_word_embeddings": (bool,),
    "rope_parameters": (dict,),
    "rope_scaling": (dict,),
}


def check_config_types(config: Any, where: str) -> None:
    """config.json is an object whose keys read here have their types (null: absent): else one line."""
    if not isinstance(config, dict):
        raise LauncherError(f"{where}: config.json is not a JSON object: give a Hugging Face model folder")
    nested = {f"rope_parameters.{k}": v for k, v in (config.get("rope_parameters") or {}).items()}
    for key, value in {**config, **nested}.items():
        types = CONFIG_TYPES.get(key.removeprefix("rope_parameters."), ())
        if (
            value is not None
            and types
            and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types))
        ):
            kind = " or ".join(t.__name__.replace("dict", "object") for t in types)
            raise LauncherError(f"{where}: config.json has {key}={value!r}, not a JSON {kind}: fix config.json")


# config.json keys that shapes cannot show, beside the model keys they must equal
SETTINGS = {
    "rms_norm_eps": ("norm_eps", lambda hf: hf.get("rms_norm_eps", 1e-6)),
    "rope_theta": ("rope_theta", rope_theta),
    "tie_word_embeddings": ("tied_embeddings", lambda hf: hf.get("tie_word_embeddings", False)),
}


@dataclass(frozen=True)
class HFFolder:
    """An HF model folder: its config.json and which shard file holds each tensor."""

    path: Path
    config: dict[str, Any]
    files: dict[str, str]  # HF tensor name → shard file name
    # open shards by file name: each header is parsed and mapped once, not once per tensor
    handles: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def shard(self, hf: str) -> Any:
        """The open (memory-mapped) shard file holding tensor `hf`."""
        from safetensors import safe_open

        name = self.files[hf]
        if name not in self.handles:
            self.handles[name] = safe_open(self.path / name, framework="pt")
        return self.handles[name]

    @classmethod
    def open(cls, path: str | Path, key: str = "init.from") -> HFFolder:
        folder = Path(path).expanduser()
        fix = "give a Hugging Face model folder (config.json and model*.safetensors)"
        try:
            config = json.loads((folder / CONFIG).read_text())
            if (folder / INDEX).is_file():
                files = json.loads((folder / INDEX).read_text())["weight_map"]
            else:
                files = dict.fromkeys(safetensors_keys(folder / SINGLE), SINGLE)
        except Exception as err:  # OSError, JSON, a damaged safetensors header (SafetensorError) ...
            raise LauncherError(f"{key}={path}: cannot read it ({type(err).__name__}: {err}): {fix}") from None
        check_config_types(config, f"{key}={path}")
        return cls(folder, config, files)

    def source(self, name: str) -> str:
        """The HF tensor holding our parameter `name` (tied embeddings: the output reads the embedding)."""
        hf = hf_name(name)
        if hf == "lm_head.weight" and hf not in self.files:
            return "model.embed_tokens.weight"
        return hf

    def shape(self, hf: str) -> tuple[int, ...]:
        """A tensor's shape from its shard's header; a LauncherError naming the file when it is unreadable."""
        file = self.path / self.files[hf]
        try:
            return tuple(self.shard(hf).get_slice(hf).get_shape())
        except Exception as err:
            raise LauncherError(
                f"init.from={self.path}: cannot read {hf} from {file.name} ({type(err).__name__}: {err}): "
                "copy the folder again"
            ) from None

    def fill_(self, local: torch.Tensor, name: str, offset: tuple[int, ...]) -> None:
        """Copy the box of parameter `name` at `offset`, of `local`'s shape, from the shard into `local`:
        only that box is read from the memory-mapped file."""
        hf = self.source(name)
        box = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
        local.copy_(self.shard(hf).get_slice(hf)[box])


def safetensors_keys(file: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        return list(f.keys())


def load_weights(parts: list[Any], path: str | None) -> None:
    """init.from: this rank's shards of `parts` (allocated by `parallelize`) read from the HF folder at
    `path`, each rank only its own boxes; nothing without a folder (the shards keep their seeded values)."""
    from launcher.model.init import fill_from

    if path:
        fill_from(parts, HFFolder.open(path))


def check_folder(model: ModelConfig, path: str | None) -> None:
    """Before any worker starts: `init.from` is a readable Llama folder whose tensors have exactly the
    model's shapes, and whose settings (norm eps, RoPE theta, tied embeddings) are the model's; else one
    line naming the first that differs and the fix."""
    from launcher.model.init import meta_model

    if not path:
        return
    check_llama(model, "init.from")
    require("safetensors", what="init.from")
    folder = HFFolder.open(path)
    scaling = folder.config.get("rope_parameters") or folder.config.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default":  # e.g. Llama 3.1's "llama3" frequency scaling: other positions than ours
        raise LauncherError(
            f"init.from={path}: its config.json scales RoPE (rope_type={rope_type}), which the model does not: "
            "give a folder with default RoPE"
        )
    for hf_key, (key, read) in SETTINGS.items():
        theirs, ours = read(folder.config), getattr(model, key)
        if theirs != ours and not (isinstance(ours, float) and math.isclose(theirs, ours, rel_tol=1e-9)):
            raise LauncherError(
                f"init.from={path}: its config.json has {hf_key}={theirs} but model.{key}={ours}: "
                f"set model.{key}={theirs}"
            )
    for name, p in meta_model(model).named_parameters():
        hf = folder.source(name)
        if hf not in folder.files:
            raise LauncherError(f"init.from={path} holds no tensor {hf} (the model's {name}): give a Llama folder")
        shape = folder.shape(hf)
        if shape != tuple(p.shape):
            raise LauncherError(
                f"init.from={path} holds {hf} with shape {shape} but the model's {name} is {tuple(p.shape)}: "
                "choose the model (+model=, model.*) the folder was saved with"
            )
