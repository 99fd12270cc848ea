"""The model's architecture keys (`model.*`, `+model=NAME` picks a file of them under conf/model/): its
shape, its norm, MLP and positions, and for a mixture of experts the routing. The planner reads these to
count FLOPs and bytes, the runtime to build the model; no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from launcher.config.ranges import ranged


@dataclass(unsafe_hash=True)  # hashed by its fields: the planner memoises on the model (planner/memo.py)
class MoEConfig:
    """Mixture of experts (launcher/model/moe.py); `experts=0`: a dense model."""

    experts: int = ranged(0, ge=0)  # routed experts per MoE layer; 0: dense MLP everywhere
    top_k: int = ranged(2, ge=1)  # routed experts per token
    shared_experts: int = ranged(0, ge=0)  # experts every token passes through (DeepSeek)
    expert_ffn_dim: int | None = ranged(None, ge=1, integer=True)  # None: model.ffn_dim
    first_dense_layers: int = ranged(0, ge=0)  # leading layers keeping a dense MLP (DeepSeek: 3)
    score: str = "sigmoid"  # sigmoid (DeepSeek-V3) | softmax; top-k weights normalized to sum 1
    capacity_factor: float | None = ranged(None, gt=0)  # tokens per expert / fair share; None: dropless
    balance: str = "bias"  # bias (auxiliary-loss-free) | aux | none
    bias_update_rate: float = ranged(0.001, ge=0)  # gamma: step of the selection bias per optimizer step
    aux_loss_coef: float = ranged(0.01, ge=0)  # balance=aux: weight of the load-balancing loss
    seq_aux_loss_coef: float = ranged(0.0, ge=0)  # sequence-wise balance loss (any balance); 0: off
    # planner, ep > 1: the busiest ep rank's routed (token, expert) rows over the mean; 1.1 assumes routing
    # balanced (a fresh model's first steps can route most tokens to one expert: docs/planner.md)
    rank_imbalance: float = ranged(1.1, ge=1)
    # a benchmark's knob (Megatron's force load balancing): token t's pick j goes to expert (t*k + j) % experts,
    # gated by the router's scores there; every expert gets its share of rows, known without reading a tensor
    # (simulate=true sets it: fake tensors have no values to route by)
    force_balance: bool = False


@dataclass(unsafe_hash=True)  # hashed by its fields: the planner memoises on the model (planner/memo.py)
class ModelConfig:
    """Architecture. Defaults are conf/model/small.yaml, field for field (tests/unit/test_config.py), so `train`
    and `train +model=small` build the same model and load each other's checkpoints."""

    name: str = "small"
    dim: int = ranged(256, ge=1)
    n_layers: int = ranged(4, ge=1)
    n_heads: int = ranged(8, ge=1)
    n_kv_heads: int | None = ranged(4, ge=1, integer=True)  # None: as many as n_heads (no GQA)
    head_dim: int | None = ranged(None, ge=1, integer=True)  # None: dim / n_heads (Qwen3: 128 at any width)
    ffn_dim: int = ranged(688, ge=1)  # hidden width of the MLP (per gate for SwiGLU)
    vocab_size: int = ranged(256, ge=1)
    max_seq_len: int = ranged(1024, ge=1)
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    norm_eps: float = ranged(1e-5, gt=0)
    norm_position: str = "pre"  # pre | post
    mlp: str = "swiglu"  # swiglu | gelu
    positions: str = "rope"  # rope | learned
    rope_theta: float = ranged(10000.0, gt=0)
    tied_embeddings: bool = False
    bias: bool = False  # biases in linear layers (GPT-2 style)
    dropout: float = ranged(0.0, ge=0, lt=1)
    init_std: float = ranged(0.02, gt=0)
    moe: MoEConfig = field(default_factory=MoEConfig)
