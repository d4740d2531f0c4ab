"""Coverage audit: which requested parts of a peft-wrapped model really got LoRA.

A recipe is only as good as what peft actually wrapped: names that match nothing, or
that peft silently rewrites (gate/up/down_proj onto fused experts), leave parts of the
model untrained without an error. The audit walks every decoder layer of the wrapped
model – real or on the `meta` device, so a 30B model audits in seconds – and reports,
per requested target kind, each module/parameter that is expected there and whether a
LoRA adapter sits on it, plus the router's state and the trainable parameter count.

`PARTS` is the registry of target kinds: where a family keeps each part, how peft
reaches it, and in which layers the model has it. The recipe builders read it too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from moetune.config import LoraArgs
from moetune.model.families.registry import ModulePaths, get_family
from moetune.model.layers import decoder_layers
from moetune.model.spec import ModelSpec

if TYPE_CHECKING:
    from torch import nn

# module: an nn.Linear for `target_modules`; param: a fused nn.Parameter path for
# `target_parameters`; weight: a module whose `.weight` must go through target_parameters
# because it is not an nn.Linear (the TopKRouter classes).
Via = Literal["module", "param", "weight"]


@dataclass(frozen=True)
class Part:
    """One target kind (attention, experts, dense, shared, router)."""

    kind: str
    label: str
    via: Via
    peft: Callable[[ModulePaths], tuple[str, ...]]
    mlx: Callable[[ModulePaths], tuple[str, ...]]
    layers: Callable[[ModelSpec], tuple[int, ...]]


def _shared_layers(spec: ModelSpec) -> tuple[int, ...]:
    has_shared = spec.num_shared_experts > 0 or spec.shared_intermediate_size > 0
    return spec.moe_layers if has_shared else ()


PARTS: dict[str, Part] = {
    p.kind: p
    for p in (
        Part("attention", "attention projections", "module",
             lambda p: p.attention, lambda p: p.mlx_attention, lambda s: s.attention_layers),
        Part("experts", "routed experts", "param",
             lambda p: p.expert_params, lambda p: p.mlx_experts, lambda s: s.moe_layers),
        Part("dense", "dense MLP layers", "module",
             lambda p: p.dense_mlp, lambda p: p.mlx_dense, lambda s: s.dense_layers),
        Part("shared", "shared experts", "module",
             lambda p: p.shared, lambda p: p.mlx_shared, _shared_layers),
        Part("router", "router", "weight",
             lambda p: p.router, lambda p: p.mlx_router, lambda s: s.moe_layers),
    )
}  # fmt: skip


def requested_kinds(lora: LoraArgs) -> tuple[str, ...]:
    """lora.targets in order, plus the router when `train_router` is set."""
    kinds = list(dict.fromkeys(lora.targets))
    if lora.train_router and "router" not in kinds:
        kinds.append("router")
    return tuple(kinds)


def absent_reason(kind: str, spec: ModelSpec) -> str | None:
    """Why `spec` has nothing of `kind` ("not present"), or None when it has some.

    A part the spec has but the family names no path for is *not* absent: the audit
    reports it as missed, so a gap in a family table cannot pass as full coverage.
    """
    part = PARTS[kind]
    return None if part.layers(spec) else f"{spec.name} has no {part.label}"


def split_target(part: Part, path: str) -> tuple[str, str]:
    """(module path, parameter name) that LoRA must reach for one family path."""
    if part.via == "param":
        module, _, param = path.rpartition(".")
        return module, param
    return path, "weight"


# ---------------------------------------------------------------- the report


@dataclass(frozen=True)
class CoverageRow:
    """One expected module/parameter in one layer; rank None means it got no LoRA."""

    layer: int
    kind: str
    target: str  # layer-relative module path, plus ".<param>" for fused parameters
    rank: int | None
    present: bool = True  # False: the family path names nothing in this layer

    @property
    def adapted(self) -> bool:
        return self.rank is not None


@dataclass(frozen=True)
class CoverageReport:
    """What a peft-wrapped model adapts, against what the LoRA config asked for."""

    model: str
    kinds: tuple[str, ...]
    rows: tuple[CoverageRow, ...]
    absent: dict[str, str]  # requested kind -> why the model has none ("not present")
    router: dict[int, str]  # MoE layer -> "frozen" | "lora" | "trained"
    trainable_params: int
    total_params: int
    num_layers: int = 0
    ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)  # kind -> ranks seen
    not_targeted: dict[str, str] = field(default_factory=dict)  # layer-relative path -> why

    @property
    def expected(self) -> int:
        return len(self.rows)

    @property
    def adapted(self) -> int:
        return sum(r.adapted for r in self.rows)

    @property
    def coverage(self) -> float:
        """Adapted / expected over the requested targets (0 when nothing is expected)."""
        return self.adapted / self.expected if self.rows else 0.0

    @property
    def missed(self) -> tuple[CoverageRow, ...]:
        return tuple(r for r in self.rows if not r.adapted)

    @property
    def unresolved(self) -> dict[str, tuple[str, ...]]:
        """kind -> family paths that named no module where the part should be."""
        out: dict[str, tuple[str, ...]] = {}
        for row in self.rows:
            if not row.present and row.target not in out.get(row.kind, ()):
                out[row.kind] = (*out.get(row.kind, ()), row.target)
        return out

    @property
    def router_adapted(self) -> bool:
        return any(state != "frozen" for state in self.router.values())

    @property
    def trainable_fraction(self) -> float:
        return self.trainable_params / self.total_params if self.total_params else 0.0

    def by_kind(self) -> dict[str, tuple[int, int]]:
        """kind -> (adapted, expected) over all layers."""
        out: dict[str, tuple[int, int]] = {}
        for kind in self.kinds:
            rows = [r for r in self.rows if r.kind == kind]
            out[kind] = (sum(r.adapted for r in rows), len(rows))
        return out

    def missed_summary(self, limit: int = 6) -> str:
        """The missed targets grouped by kind and path, e.g. 'dense mlp.gate_proj (layers 0)'."""
        groups: dict[tuple[str, str], list[int]] = {}
        for row in self.missed:
            label = row.target if row.present else f"{row.target} (not in model)"
            groups.setdefault((row.kind, label), []).append(row.layer)
        parts = [f"{k} {t} (layers {_span(ls)})" for (k, t), ls in groups.items()]
        more = f" and {len(parts) - limit} more" if len(parts) > limit else ""
        return "; ".join(parts[:limit]) + more

    def table(self) -> tuple[list[str], list[list[str]]]:
        """(header, rows) per layer: 'adapted/expected' per requested kind, router state."""
        header = ["layer", *(k for k in self.kinds if k != "router"), "router"]
        cells: dict[tuple[int, str], list[bool]] = {}
        for row in self.rows:
            cells.setdefault((row.layer, row.kind), []).append(row.adapted)
        body = []
        for i in range(self.num_layers):
            line = [str(i)]
            for kind in header[1:-1]:
                got = cells.get((i, kind))
                line.append(f"{sum(got)}/{len(got)}" if got else "–")
            line.append(self.router.get(i, "–"))
            body.append(line)
        return header, body

    def to_json(self) -> dict[str, Any]:
        header, body = self.table()
        return {
            "model": self.model,
            "targets": list(self.kinds),
            "coverage": self.coverage,
            "adapted": self.adapted,
            "expected": self.expected,
            "by_kind": {k: {"adapted": a, "expected": e} for k, (a, e) in self.by_kind().items()},
            "ranks": {k: list(v) for k, v in self.ranks.items()},
            "not_present": self.absent,
            "not_targeted": dict(self.not_targeted),
            "unresolved_paths": {k: list(v) for k, v in self.unresolved.items()},
            "missed": [{"layer": r.layer, "kind": r.kind, "target": r.target} for r in self.missed],
            "router_adapted": self.router_adapted,
            "router": {str(k): v for k, v in self.router.items()},
            "trainable_params": self.trainable_params,
            "total_params": self.total_params,
            "trainable_fraction": self.trainable_fraction,
            "table": {"header": header, "rows": body},
        }


def _span(layers: list[int]) -> str:
    if len(layers) > 3 and layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}–{layers[-1]}"
    return ", ".join(map(str, layers))


# ---------------------------------------------------------------- walking the model


def _is_tuner_layer(module: nn.Module) -> bool:
    # lazy: heavy to import (peft)
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(module, BaseTunerLayer)


def _inner(wrapper: nn.Module) -> nn.Module:
    """The module one peft wrapper wraps."""
    inner = wrapper._modules["base_layer"]
    assert inner is not None
    return inner


def _unwrap(module: nn.Module) -> nn.Module:
    while _is_tuner_layer(module):
        module = _inner(module)
    return module


def _wrapped_rank(module: nn.Module, param: str) -> int | None:
    """LoRA rank on `param` of a (possibly nested) peft wrapper chain, None if not adapted.

    peft nests one ParamWrapper per adapted parameter; a lora.Linear adapts `weight`.
    """
    while _is_tuner_layer(module):
        ranks: dict[str, int] = getattr(module, "r", {})
        if getattr(module, "parameter_name", "weight") == param and ranks:
            return max(ranks.values())
        module = _inner(module)
    return None


def _layer_modules(layer: nn.Module) -> dict[str, nn.Module]:
    """Layer-relative module names as in the unwrapped model -> the outermost module there.

    Wrappers insert `base_layer` and `lora_*` submodules; dropping them gives back the
    original names, so family paths resolve the same before and after peft.
    """
    found: dict[str, nn.Module] = {}
    for name, module in layer.named_modules():
        parts = name.split(".") if name else []
        if any(p.startswith("lora_") for p in parts):
            continue
        found.setdefault(".".join(p for p in parts if p != "base_layer"), module)
    return found


def _matches(names: Iterable[str], path: str) -> list[str]:
    """Names equal to `path` or ending in `.path` – peft's own suffix rule."""
    return [n for n in names if n == path or n.endswith(f".{path}")]


def _resolve(
    modules: dict[str, nn.Module], part: Part, path: str
) -> Iterator[tuple[str, int | None]]:
    """(target name, rank) for every place `path` names in one layer."""
    module_path, param = split_target(part, path)
    for name in _matches(modules, module_path):
        outer = modules[name]
        if not _holds(_unwrap(outer), param):
            continue
        target = f"{name}.{param}" if part.via == "param" else name
        yield target, _wrapped_rank(outer, param)


def _holds(module: nn.Module, param: str) -> bool:
    """A Parameter of that name, or a quantised or offloaded expert stack standing in for it."""
    from moetune.engine.offload.store import offloaded_of  # torch: imported only when auditing
    from moetune.engine.quant.stacks import stacks_of

    held = param in module._parameters or param in stacks_of(module)
    return held or param in offloaded_of(module)


def _router_state(modules: dict[str, nn.Module], paths: tuple[str, ...]) -> str:
    """frozen, lora (a LoRA adapter on its weight) or trained (its own weights train)."""
    for path in paths:
        for name in _matches(modules, path):
            outer = modules[name]
            if _wrapped_rank(outer, "weight") is not None:
                return "lora"
            if any(p.requires_grad for p in _unwrap(outer).parameters()):
                return "trained"
    return "frozen"


def _audit_part(
    part: Part, layers: list[nn.Module], spec: ModelSpec, paths: ModulePaths
) -> list[CoverageRow]:
    """Rows for one kind over the layers where the spec says it is. A family path that
    names nothing there is a missed row too: the part exists under another name (paths
    derived from a build say which layer has which, so hybrid layers are not misses)."""
    rows: list[CoverageRow] = []
    for i in part.layers(spec):
        modules = _layer_modules(layers[i])
        expected = tuple(p for p in part.peft(paths) if paths.in_layer(i, p))
        for path in expected or (f"<{part.label}>",):
            hits = [CoverageRow(i, part.kind, t, rank) for t, rank in _resolve(modules, part, path)]
            rows += hits or [CoverageRow(i, part.kind, path, None, present=False)]
    return rows


def audit_coverage(model: nn.Module, spec: ModelSpec, lora: LoraArgs) -> CoverageReport:
    """Per layer and requested target kind: what got LoRA, what was expected but missed,
    and whether the router is adapted. `model` is peft-wrapped (real or meta)."""
    family = get_family(spec.model_type)
    paths = family.paths_of(spec)
    layers = decoder_layers(model, spec, family)
    kinds = requested_kinds(lora)
    rows: list[CoverageRow] = []
    absent: dict[str, str] = {}
    for kind in kinds:
        reason = absent_reason(kind, spec)
        if reason:
            absent[kind] = reason
            continue
        rows += _audit_part(PARTS[kind], layers, spec, paths)
    router = {i: _router_state(_layer_modules(layers[i]), paths.router) for i in spec.moe_layers}
    ranks = {k: tuple(sorted({r.rank for r in rows if r.kind == k and r.rank})) for k in kinds}
    trainable, total = _count_params(model)
    return CoverageReport(
        spec.name, kinds, tuple(rows), absent, router, trainable, total,
        num_layers=spec.num_layers, ranks={k: v for k, v in ranks.items() if v},
        not_targeted={p: family.left_out_why(p) or NOT_PER_TOKEN for p in paths.not_targeted},
    )  # fmt: skip


# why model.read.per_token_linear leaves a Linear out of the targets
NOT_PER_TOKEN = (
    "a Linear subclass whose forward is not a per-token x·Wᵀ (DeepSeek-V4's grouped o_a_proj: "
    "a bmm over head groups); peft's LoRA adds B·A·x of another width and fails in forward"
)


def _count_params(model: nn.Module) -> tuple[int, int]:
    trainable = total = 0
    for p in model.parameters():
        size = getattr(p, "ds_numel", None) or p.numel()  # a ZeRO-3 partition: the whole's
        total += size
        trainable += size if p.requires_grad else 0
    return trainable, total
