"""ModelSpec: what a model is, computed from its config.json alone (no weights)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

COMPONENTS = (
    "embeddings",
    "attention",
    "dense_mlp",
    "routed_experts",
    "shared_experts",
    "routers",
    "norms",
    "lm_head",
    "other",
)


@dataclass(frozen=True)
class Components:
    """Parameter counts by component. `other` holds what fits no MoE-transformer slot
    (e.g. Mamba mixers in jamba, attention sinks are counted as attention)."""

    embeddings: int = 0
    attention: int = 0
    dense_mlp: int = 0
    routed_experts: int = 0
    shared_experts: int = 0
    routers: int = 0
    norms: int = 0
    lm_head: int = 0
    other: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, name) for name in COMPONENTS)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def __add__(self, other: Components) -> Components:
        return Components(**{n: getattr(self, n) + getattr(other, n) for n in COMPONENTS})

    def times(self, n: int) -> Components:
        """These counts repeated `n` times (e.g. once per layer)."""
        return Components(**{name: getattr(self, name) * n for name in COMPONENTS})


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts and exact parameter counts of one model.

    `hf_config` is the (text) config dict transformers would build the model from; the
    trace estimator rebuilds the model from it under fake tensors.
    """

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    num_shared_experts: int
    shared_intermediate_size: int
    dense_intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    components: Components
    active_params: int
    dtype: str = "bfloat16"
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # Layers that hold attention (jamba interleaves Mamba mixers); None means every layer.
    attention_layer_ids: tuple[int, ...] | None = None
    # The checkpoint's config.json `quantization_config` as published (None: a float
    # checkpoint); counts and hf_config are for the float model (engine/stored/formats.py reads it).
    quant_config: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    # Token mixer of each layer as built (attention, mla, linear_attention, mamba, conv …);
    # empty for a spec not read off a build (made by hand).
    mixers: tuple[str, ...] = ()
    # Layers with a dense MLP (a build can have layers with neither: Nemotron-H's mixer-only
    # layers); None means every non-MoE layer.
    dense_layer_ids: tuple[int, ...] | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and len(self.moe_layers) > 0

    @property
    def quant_method(self) -> str | None:
        """The checkpoint's quant_method (e.g. "mxfp4", "fp8"); None for a float one."""
        return (self.quant_config or {}).get("quant_method")

    @property
    def mixer_counts(self) -> dict[str, int]:
        """How many layers have each token-mixer kind, in layer order."""
        return {k: self.mixers.count(k) for k in dict.fromkeys(self.mixers)}

    @property
    def total_params(self) -> int:
        return self.components.total

    @property
    def attention_layers(self) -> tuple[int, ...]:
        if self.attention_layer_ids is None:
            return tuple(range(self.num_layers))
        return self.attention_layer_ids

    @property
    def dense_layers(self) -> tuple[int, ...]:
        if self.dense_layer_ids is not None:
            return self.dense_layer_ids
        moe = set(self.moe_layers)
        return tuple(i for i in range(self.num_layers) if i not in moe)

    def bytes_in(self, dtype_bytes: int = 2) -> int:
        """Size of all weights at `dtype_bytes` per parameter (2 = bf16)."""
        return self.total_params * dtype_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model_type": self.model_type,
            "is_moe": self.is_moe,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "moe_layers": list(self.moe_layers),
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "expert_intermediate_size": self.expert_intermediate_size,
            "num_shared_experts": self.num_shared_experts,
            "shared_intermediate_size": self.shared_intermediate_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "total_params": self.total_params,
            "active_params": self.active_params,
            "quant_method": self.quant_method,
            "quant_config": self.quant_config,
            "mixers": self.mixer_counts,
            "components": self.components.as_dict(),
        }
