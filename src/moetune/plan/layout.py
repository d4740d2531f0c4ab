"""Where the LoRA adapters sit, layer by layer: the input the analytic estimator needs.

The exact layout comes from the recipe's own LoraConfig applied by peft to a weightless
(`meta`) build of the model – the same code path the trace and the trainer take, so
peft's name rewriting (automap doubling gate_up's rank, dropping dense and shared MLPs)
is whatever the installed peft does. Layouts are linear in the rank, so one build per
(model, targets, mapping) serves every rank; builds are cached per process.

When the recipe cannot be built (peft missing), `formula_layout` derives a layout from
the spec alone for grouped-query-attention families.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from moetune.config import LoraArgs
from moetune.model.families import ModulePaths, get_family
from moetune.model.spec import ModelSpec

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
    """Adapters per decoder layer, at `rank` (the LoRA r of the config)."""

    rank: int
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

    def at_rank(self, rank: int) -> AdapterLayout:
        """The same targets at another rank (every LoRA size is proportional to r)."""
        if rank == self.rank:
            return self
        scale = _Scale(rank, self.rank)
        layers = tuple(tuple(scale(a) for a in layer) for layer in self.layers)
        return replace(self, rank=rank, layers=layers)


@dataclass(frozen=True)
class _Scale:
    new: int
    old: int

    def __call__(self, a: Adapter) -> Adapter:
        rank = a.rank * self.new // self.old
        return replace(a, rank=rank, lora_numel=a.lora_numel * self.new // self.old)


def adapter_layout(spec: ModelSpec, lora: LoraArgs) -> AdapterLayout:
    """The exact layout at `lora.rank` (cached meta build); the formula when peft is absent."""
    key = _key(spec, lora)
    # dropout does not move an adapter (and peft refuses it on ParamWrapper targets – a
    # trap the rules report); the layout is the same either way
    reference = lora.model_copy(update={"rank": _REFERENCE_RANK, "dropout": 0.0})
    try:
        base = _peft_layout_cached(key, spec, reference)
    except ImportError:
        return formula_layout(spec, lora)
    return base.at_rank(lora.rank)


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
    from moetune.model import build_model
    from moetune.recipe.targets import apply_peft, build_peft_config

    model, _ = apply_peft(build_model(spec, device="meta"), build_peft_config(spec, lora))
    paths = get_family(spec.model_type).paths_of(spec)
    layers: list[list[Adapter]] = [[] for _ in range(spec.num_layers)]
    for name, module in model.named_modules():
        found = _adapter(name, module, paths, lora.rank)
        if found is not None:
            layers[found[0]].append(found[1])
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    inside = sum(a.lora_numel for layer in layers for a in layer)
    return AdapterLayout(lora.rank, tuple(tuple(x) for x in layers), trainable - inside)


def _adapter(
    name: str, module: nn.Module, paths: ModulePaths, rank: int
) -> tuple[int, Adapter] | None:
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
    return int(match.group(1)), _at_reference(adapter, rank)


def _at_reference(a: Adapter, rank: int) -> Adapter:
    return a if rank == _REFERENCE_RANK else _Scale(_REFERENCE_RANK, rank)(a)


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
            adapters += _experts(spec, r)
        if i in moe and "shared" in targets and spec.shared_intermediate_size:
            adapters += _glu("shared", spec.hidden_size, spec.shared_intermediate_size, r)
        if i not in moe and "dense" in targets and spec.dense_intermediate_size:
            adapters += _glu("dense", spec.hidden_size, spec.dense_intermediate_size, r)
        layers.append(tuple(adapters))
    return AdapterLayout(r, tuple(layers), source="formula")


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
