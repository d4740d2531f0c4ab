"""Where the LoRA adapters sit, layer by layer: the input the analytic estimator needs.

The exact layout comes from the recipe's own LoraConfig applied by peft to a weightless
(`meta`) build of the model – the same code path the trace and the trainer take, so
peft's name rewriting (automap doubling gate_up's rank, dropping dense and shared MLPs)
is whatever the installed peft does. Each adapter's size is linear in its rank, so one
build per (model, targets, mapping) serves every rank and expert rank (`at_rank`); builds
are cached per process.

When the recipe cannot be built (peft missing), `formula_layout` derives a layout from
the spec alone for grouped-query-attention families.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from moetune.config import LoraArgs
from moetune.model import build_model
from moetune.model.families.registry import ModulePaths, get_family
from moetune.model.spec import ModelSpec
from moetune.recipe.targets import apply_peft, build_peft_config, check_expert_rank

if TYPE_CHECKING:
    from torch import nn

Via = Literal["linear", "param"]
_LAYER = re.compile(r"layers\.(\d+)\.(.+)$")
_REFERENCE_RANK = 8


@dataclass(frozen=True)
class Adapter:
    """One LoRA adapter.

    `via="linear"`: a peft `lora.Linear` (input cast to the adapter's fp32, base untouched).
    `via="param"`: a peft `ParamWrapper` on a parameter; every forward materialises
    `W + s·B@A` (`base_numel` elements) and backward makes a full-size weight gradient.
    """

    kind: str  # attention | experts | dense | shared | router | other
    via: Via
    name: str  # layer-relative module path (+ ":param" for ParamWrapper)
    in_features: int
    out_features: int
    rank: int
    base_numel: int
    lora_numel: int


@dataclass(frozen=True)
class AdapterLayout:
    """Adapters per decoder layer: expert stacks at `expert_rank`, the rest at `rank`
    (the config's r; automap's doubled gate_up is 2 × expert_rank)."""

    rank: int
    expert_rank: int
    layers: tuple[tuple[Adapter, ...], ...]
    extra_trainable: int = 0  # trainable parameters outside the decoder layers
    source: str = "peft"  # "peft": exact meta build; "formula": derived from the spec

    @property
    def trainable_params(self) -> int:
        return self.extra_trainable + sum(a.lora_numel for layer in self.layers for a in layer)

    def only(self, kinds: set[str]) -> AdapterLayout:
        """The adapters of `kinds` alone (what dropping the other targets leaves)."""
        keep = kinds | {"other"}
        layers = tuple(tuple(a for a in layer if a.kind in keep) for layer in self.layers)
        return replace(self, layers=layers)

    def at_rank(self, rank: int, expert_rank: int | None = None) -> AdapterLayout:
        """The same targets at `rank`, expert stacks at `expert_rank` (default: their ratio
        to rank kept); every LoRA size is proportional to its r."""
        if expert_rank is None:
            expert_rank = max(1, self.expert_rank * rank // self.rank)
        if (rank, expert_rank) == (self.rank, self.expert_rank):
            return self

        def scale(a: Adapter) -> Adapter:
            if is_expert_stack(a):
                return _scaled(a, expert_rank, self.expert_rank)
            return _scaled(a, rank, self.rank)

        layers = tuple(tuple(scale(a) for a in layer) for layer in self.layers)
        return replace(self, rank=rank, expert_rank=expert_rank, layers=layers)


def is_expert_stack(a: Adapter) -> bool:
    """A fused expert stack's ParamWrapper: it takes lora.effective_expert_rank."""
    return a.via == "param" and a.kind == "experts"


def _scaled(a: Adapter, new: int, old: int) -> Adapter:
    return replace(a, rank=a.rank * new // old, lora_numel=a.lora_numel * new // old)


def adapter_layout(spec: ModelSpec, lora: LoraArgs) -> AdapterLayout:
    """The exact layout of `lora` (cached meta build); the formula when peft is absent."""
    check_expert_rank(lora)  # the reference below has no expert rank to refuse
    key = _key(spec, lora)
    # one rank throughout (at_rank sets both); dropout does not move an adapter (and peft
    # refuses it on ParamWrapper targets – a trap the rules report)
    reference = lora.model_copy(
        update={"rank": _REFERENCE_RANK, "expert_rank": None, "dropout": 0.0}
    )
    try:
        base = _peft_layout_cached(key, spec, reference)
    except ImportError:
        return formula_layout(spec, lora)
    return base.at_rank(lora.rank, lora.effective_expert_rank)


def _key(spec: ModelSpec, lora: LoraArgs) -> str:
    fields = {
        "config": spec.hf_config,
        "targets": sorted(lora.targets),
        "mapping": lora.expert_mapping,
        "router": lora.train_router,
    }
    return f"{spec.name}|{json.dumps(fields, sort_keys=True, default=str)}"


_CACHE: dict[str, AdapterLayout] = {}


def _peft_layout_cached(key: str, spec: ModelSpec, lora: LoraArgs) -> AdapterLayout:
    if key not in _CACHE:
        _CACHE[key] = peft_layout(spec, lora)
    return _CACHE[key]


def peft_layout(spec: ModelSpec, lora: LoraArgs) -> AdapterLayout:
    """Apply the recipe's LoraConfig to a meta build and read every adapter off it."""
    model, _ = apply_peft(build_model(spec, device="meta"), build_peft_config(spec, lora))
    paths = get_family(spec.model_type).paths_of(spec)
    layers: list[list[Adapter]] = [[] for _ in range(spec.num_layers)]
    for name, module in model.named_modules():
        found = _adapter(name, module, paths)
        if found is not None:
            layers[found[0]].append(found[1])
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    inside = sum(a.lora_numel for layer in layers for a in layer)
    per_layer = tuple(tuple(x) for x in layers)
    return AdapterLayout(lora.rank, lora.effective_expert_rank, per_layer, trainable - inside)


def _adapter(name: str, module: nn.Module, paths: ModulePaths) -> tuple[int, Adapter] | None:
    # lazy: heavy to import (peft)
    from peft.tuners.lora import Linear, ParamWrapper

    match = _LAYER.search(name)
    if match is None or not isinstance(module, Linear | ParamWrapper):
        return None
    local = re.sub(r"^(self_attn|attn|attention)\.", "", match.group(2))
    lora_numel = sum(p.numel() for p in module.lora_A.parameters())
    lora_numel += sum(p.numel() for p in module.lora_B.parameters())
    r = next(iter(module.r.values()))
    fan_in, fan_out = int(module.in_features or 0), int(module.out_features or 0)
    via: Via = "linear"
    base_numel = fan_in * fan_out
    if isinstance(module, ParamWrapper):
        local = f"{local.removesuffix('.base_layer')}:{module.parameter_name}"
        base_numel, via = module.get_param().numel(), "param"
    adapter = Adapter(_kind(local, paths), via, local, fan_in, fan_out, r, base_numel, lora_numel)
    return int(match.group(1)), adapter


def _kind(local: str, paths: ModulePaths) -> str:
    """Which target kind a layer-relative name belongs to (router before MLP names)."""
    module = local.split(":")[0]
    groups = (
        ("router", paths.router),
        ("experts", tuple(p.rpartition(".")[0] for p in paths.expert_params)),
        ("shared", paths.shared),
        ("dense", paths.dense_mlp),
        ("attention", paths.attention),
    )
    for kind, names in groups:
        if any(module == n or module.endswith("." + n) or n.endswith(module) for n in names):
            return kind
    return "other"


# ---------------------------------------------------------------- spec-only fallback


def formula_layout(spec: ModelSpec, lora: LoraArgs) -> AdapterLayout:
    """A layout from the spec alone (GQA attention, fused experts, GLU MLPs); no peft quirks."""
    r, targets = lora.rank, set(lora.targets)
    moe = set(spec.moe_layers)
    layers = []
    for i in range(spec.num_layers):
        adapters: list[Adapter] = []
        if "attention" in targets:
            adapters += _attention(spec, r)
        if i in moe and "experts" in targets:
            adapters += _experts(spec, lora.effective_expert_rank)
        if i in moe and "shared" in targets and spec.shared_intermediate_size:
            adapters += _glu("shared", spec.hidden_size, spec.shared_intermediate_size, r)
        if i not in moe and "dense" in targets and spec.dense_intermediate_size:
            adapters += _glu("dense", spec.hidden_size, spec.dense_intermediate_size, r)
        layers.append(tuple(adapters))
    return AdapterLayout(r, lora.effective_expert_rank, tuple(layers), source="formula")


def _linear(kind: str, name: str, fan_in: int, fan_out: int, r: int) -> Adapter:
    return Adapter(
        kind, "linear", name, fan_in, fan_out, r, fan_in * fan_out, r * (fan_in + fan_out)
    )


def _attention(spec: ModelSpec, r: int) -> list[Adapter]:
    h, q = spec.hidden_size, spec.num_attention_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    dims = (("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv), ("o_proj", q, h))
    return [_linear("attention", n, i, o, r) for n, i, o in dims]


def _experts(spec: ModelSpec, r: int) -> list[Adapter]:
    e, h, inter = spec.num_experts, spec.hidden_size, spec.expert_intermediate_size
    stacks = (("gate_up_proj", h, 2 * inter), ("down_proj", inter, h))
    return [
        Adapter("experts", "param", f"experts:{n}", i, o, r, e * i * o, r * e * (i + o))
        for n, i, o in stacks
    ]


def _glu(kind: str, hidden: int, inter: int, r: int) -> list[Adapter]:
    dims = (("gate_proj", hidden, inter), ("up_proj", hidden, inter), ("down_proj", inter, hidden))
    return [_linear(kind, n, i, o, r) for n, i, o in dims]
