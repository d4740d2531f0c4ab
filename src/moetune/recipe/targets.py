"""The peft LoRA recipe: a LoraConfig that really reaches the experts, proven by an audit.

Two ways to name the targets:

- explicit (moetune's): attention, dense-MLP and shared-expert Linears by layer-relative
  path in `target_modules`; the fused expert stacks by path in `target_parameters`
  (rank r per expert, no doubling; `lora.expert_rank` gives them their own rank through
  `rank_pattern` / `alpha_pattern` keyed by those parameter paths). Where the installed
  peft rewrites a name from `target_modules` (peft >= 0.19 moves
  `gate_proj/up_proj/down_proj` onto the fused experts and drops it, taking dense and
  shared MLPs with it – peft #3711), that Linear's `.weight` goes to `target_parameters`
  instead: the same LoRA, a name peft leaves alone.
- automap: what a vanilla peft user writes (attention names plus gate/up/down). Lossy on
  purpose, so the planner can trace it and the audit can show what it misses.

`make_recipe` builds the model on the meta device, applies the config, audits it and
emits the recipe only when every requested target got LoRA.
"""

from __future__ import annotations

import ast
import copy
import json
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moetune.config import LoraArgs
from moetune.config.keys import splits
from moetune.errors import RecipeError
from moetune.model import build_model
from moetune.model.families.registry import Family, get_family
from moetune.model.layers import layers_prefix
from moetune.model.spec import ModelSpec
from moetune.recipe.audit import (
    PARTS,
    CoverageReport,
    absent_reason,
    audit_coverage,
    requested_kinds,
)

if TYPE_CHECKING:
    from peft import LoraConfig
    from torch import nn

PEFT_DROPOUT_ERROR = "lora.ParamWrapper does not work with lora_dropout != 0."
# peft 0.21 checks rank_pattern / alpha_pattern keys against targeted *module* names only,
# although it applies keys naming target_parameters to their ParamWrappers
_PATTERN_MISS = re.compile(
    r"The following (?:rank|alpha)_pattern keys did not match any targeted module "
    r"and were ignored: (\[.*\])\.$"
)
_VANILLA_MLP = ("gate_proj", "up_proj", "down_proj")
_MLP_KINDS = frozenset({"experts", "dense", "shared"})


def peft_name_map(model_type: str) -> dict[str, str]:
    """The target_modules names the installed peft rewrites for `model_type` (old -> new).

    Read from peft's own tables, under the same conditions peft applies them, so the
    recipe follows the library rather than a remembered version.
    """
    try:
        # lazy: heavy to import (peft, transformers)
        from peft.utils import transformers_weight_conversion as conv
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # transformers < 5 or a peft without the mapping: nothing is rewritten
        return {}
    if get_checkpoint_conversion_mapping(model_type) is None:
        return {}
    pattern = conv._MODEL_TO_CONVERSION_PATTERN.get(model_type)
    if pattern is None or not conv._MOE_FUSED_TARGETS.get(pattern):
        return {}
    return dict(conv._MOE_TARGET_MODULE_MAPPING.get(pattern, {}))


def _leaf(path: str) -> str:
    return path.rpartition(".")[2]


@dataclass(frozen=True)
class PeftTargets:
    """target_modules / target_parameters for one (spec, lora) pair."""

    modules: tuple[str, ...]
    parameters: tuple[str, ...]
    param_wrapped: tuple[str, ...]  # what peft will wrap with lora.ParamWrapper
    experts: tuple[str, ...] = ()  # the fused expert stacks among `parameters`


def _explicit(spec: ModelSpec, family: Family, kinds: tuple[str, ...]) -> PeftTargets:
    rewritten = peft_name_map(spec.model_type)
    paths = family.paths_of(spec)
    modules: list[str] = []
    params: list[str] = []
    experts: list[str] = []
    for kind in kinds:
        part = PARTS[kind]
        if absent_reason(kind, spec):
            continue
        for path in part.peft(paths):
            if part.via == "param":  # the fused expert stacks
                params.append(path)
                experts.append(path)
            elif part.via == "weight" or _leaf(path) in rewritten:
                params.append(f"{path}.weight")
            else:
                modules.append(path)
    unique = tuple(dict.fromkeys(params))
    return PeftTargets(tuple(dict.fromkeys(modules)), unique, tuple(params), tuple(experts))


def _automap(spec: ModelSpec, family: Family, kinds: tuple[str, ...]) -> PeftTargets:
    rewritten = peft_name_map(spec.model_type)
    paths = family.paths_of(spec)
    # a vanilla user writes the v4 per-expert names; peft's table says which it knows
    mlp = [old for old, new in rewritten.items() if not new.endswith(".weight")]
    names: list[str] = []
    if "attention" in kinds:
        names += [_leaf(p) for p in paths.attention]
    if _MLP_KINDS & set(kinds):
        names += mlp or list(_VANILLA_MLP)
    if "router" in kinds:
        names += [_leaf(p) for p in paths.router]
    unique = tuple(dict.fromkeys(names))
    return PeftTargets(unique, (), tuple(n for n in unique if n in rewritten))


_MAPPINGS: dict[str, Callable[[ModelSpec, Family, tuple[str, ...]], PeftTargets]] = {
    "explicit": _explicit,
    "automap": _automap,
}


def _check_moe(spec: ModelSpec, kinds: tuple[str, ...]) -> None:
    if "experts" in kinds and not spec.is_moe:
        raise RecipeError(
            f"model {spec.name} is dense: it has no experts",
            "drop 'experts' from lora.targets (e.g. --targets attention,dense)",
        )


def split_experts(spec: ModelSpec, lora: LoraArgs) -> bool:
    """moetune's engine computes the expert LoRA (and applies its dropout)."""
    # lazy: heavy to import (moetune.engine)
    from moetune.engine.resolve import resolve_engine

    return splits(resolve_engine(spec, lora))


def _no_dropout(spec: ModelSpec, lora: LoraArgs, targets: PeftTargets) -> tuple[str, ...]:
    """Parameter targets peft would wrap without dropout: all on peft's engine; on moetune's,
    those that are not expert stacks (automap's names all land on the experts)."""
    if not split_experts(spec, lora):
        return targets.param_wrapped
    if lora.expert_mapping == "automap":
        return ()
    return tuple(t for t in targets.param_wrapped if t not in targets.experts)


def _check_dropout(spec: ModelSpec, lora: LoraArgs, targets: PeftTargets) -> None:
    refused = _no_dropout(spec, lora, targets) if lora.dropout else ()
    if refused:
        shown = ", ".join(refused[:3])
        raise RecipeError(
            f"lora.dropout={lora.dropout} cannot be used: {shown} are adapted through "
            f"target_parameters and peft raises {PEFT_DROPOUT_ERROR!r} (no per-module dropout)",
            "keep lora.engine auto or moetune for expert stacks (split LoRA applies their "
            "dropout) and drop other parameter targets, or set lora.dropout: 0",
        )


def check_expert_rank(lora: LoraArgs) -> None:
    """RecipeError when `lora.expert_rank` cannot be honoured (automap mapping)."""
    if lora.effective_expert_rank != lora.rank and lora.expert_mapping == "automap":
        raise RecipeError(
            f"lora.expert_rank={lora.expert_rank} needs explicit expert targets: automap's "
            "gate/up/down_proj names also hit dense and shared MLPs, so no rank can single "
            "out the experts",
            "set lora.expert_mapping: explicit, or drop lora.expert_rank",
        )


def peft_targets(spec: ModelSpec, lora: LoraArgs) -> PeftTargets:
    """The target_modules / target_parameters for `lora` on `spec` (validated)."""
    kinds = requested_kinds(lora)
    _check_moe(spec, kinds)
    check_expert_rank(lora)
    family = get_family(spec.model_type)
    targets = _MAPPINGS[lora.expert_mapping](spec, family, kinds)
    if not targets.modules and not targets.parameters:
        raise RecipeError(
            f"{spec.name}: none of lora.targets ({', '.join(kinds)}) exists in this model",
            "pick targets the model has (attention is always a safe start)",
        )
    _check_dropout(spec, lora, targets)
    return targets


def scoped(targets: PeftTargets, model: nn.Module, prefix: str) -> PeftTargets:
    """`targets` named by full path under the decoder layers at `prefix` (a multimodal
    checkpoint's language model, whose towers may have Linears of the same names). peft
    rewrites target names by the *checkpoint's* model type (peft_name_map) and resolves a
    regex to bare leaf names, so each target is one full path: a module, or – where peft
    would rewrite its name – its `.weight`."""
    rewritten = peft_name_map(str(getattr(model.config, "model_type", "")))
    layers: Any = model.get_submodule(prefix)  # a ModuleList
    modules: list[str] = []
    params: list[str] = []
    for i, layer in enumerate(layers):
        for name, _ in layer.named_modules():
            if name and _suffix_in(name, targets.modules):
                full = f"{prefix}.{i}.{name}"
                if _leaf(name) in rewritten:
                    params.append(f"{full}.weight")
                else:
                    modules.append(full)
        params += [
            f"{prefix}.{i}.{n}"
            for n, _ in layer.named_parameters()
            if _suffix_in(n, targets.parameters)
        ]
    experts = tuple(p for p in params if _suffix_in(p, targets.experts))
    return PeftTargets(tuple(modules), tuple(params), tuple(params), experts)


def _suffix_in(name: str, targets: tuple[str, ...]) -> bool:
    """peft's list match: the name itself or a `.`-separated suffix of it."""
    return any(name == t or name.endswith(f".{t}") for t in targets)


def build_peft_config(
    spec: ModelSpec, lora: LoraArgs, model: nn.Module | None = None
) -> LoraConfig:
    """A fresh peft LoraConfig for `lora` on `spec`; given the `model` it will wrap, where
    that is not the spec's text model (a multimodal checkpoint's own class), the targets
    are named by full path under its language model's decoder layers.

    Note that `get_peft_model` rewrites the config it is given in place on transformers 5
    models; pass a copy if the original must stay as written.
    """
    # lazy: heavy to import (peft)
    from peft import LoraConfig

    targets = peft_targets(spec, lora)
    family = get_family(spec.model_type)
    prefix = layers_prefix(model, spec, family) if model is not None else family.layers_prefix
    if model is not None and prefix != family.layers_prefix:
        targets = scoped(targets, _base(model), prefix)
        _check_dropout(spec, lora, targets)
    stacks = targets.experts if lora.effective_expert_rank != lora.rank else ()
    return LoraConfig(
        r=lora.rank,
        lora_alpha=_alpha(lora.effective_alpha),
        # peft's ParamWrapper refuses dropout: moetune's engine applies it after the build
        # (engine.apply_lora_dropout), and _check_dropout refused every other case
        lora_dropout=0.0 if targets.param_wrapped else lora.dropout,
        # [] rather than None: None makes peft fill in its per-model default modules
        target_modules=list(targets.modules),
        target_parameters=list(targets.parameters) or None,
        # keyed by the parameter paths: peft matches them against each ParamWrapper's key
        rank_pattern=dict.fromkeys(stacks, lora.effective_expert_rank),
        alpha_pattern=dict.fromkeys(stacks, _alpha(lora.effective_expert_alpha)),
        bias="none",
        task_type="CAUSAL_LM",
    )


def _base(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _alpha(value: float) -> Any:
    """peft types lora_alpha as int; keep 32.0 as 32 so the config reads as users write it."""
    return int(value) if float(value).is_integer() else value


def apply_peft(model: nn.Module, config: LoraConfig) -> tuple[nn.Module, list[str]]:
    """get_peft_model on a copy of `config`, with peft's warnings captured (not printed)."""
    # lazy: heavy to import (peft)
    from peft import get_peft_model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            wrapped = get_peft_model(model, copy.deepcopy(config), low_cpu_mem_usage=True)
        except ValueError as exc:  # peft refuses a target (unsupported module type, …)
            raise RecipeError(
                f"peft rejected the LoRA config: {exc}", "adjust lora.targets"
            ) from exc
    return wrapped, peft_notes(caught, config)


def peft_notes(caught: Iterable[warnings.WarningMessage], config: LoraConfig) -> list[str]:
    """peft's warnings in `caught`, deduplicated, less its false pattern-key miss for keys
    that name `config.target_parameters` (applied to the ParamWrappers all the same)."""
    params = set(config.target_parameters or ())
    notes = [str(w.message) for w in caught if "peft" in (w.filename or "")]
    return list(dict.fromkeys(n for n in notes if not _false_pattern_miss(n, params)))


def _false_pattern_miss(note: str, params: set[str]) -> bool:
    match = _PATTERN_MISS.match(note)
    return match is not None and set(ast.literal_eval(match.group(1))) <= params


# ---------------------------------------------------------------- the recipe


@dataclass(frozen=True)
class Recipe:
    """A LoRA recipe that was applied to the model and audited."""

    stack: str
    peft_config: dict[str, Any]  # LoraConfig.to_dict(), JSON-ready
    snippet: str  # python the user can paste
    coverage: CoverageReport
    trainable_params: int
    trainable_fraction: float
    peft_warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "stack": self.stack,
            "peft_config": self.peft_config,
            "snippet": self.snippet,
            "coverage": self.coverage.to_json(),
            "trainable_params": self.trainable_params,
            "trainable_fraction": self.trainable_fraction,
            "peft_warnings": self.peft_warnings,
        }


def config_dict(config: LoraConfig) -> dict[str, Any]:
    """LoraConfig.to_dict() made JSON-serialisable (sets sorted, enums as values)."""

    def default(value: Any) -> Any:
        return sorted(value) if isinstance(value, set | frozenset) else str(value)

    data: dict[str, Any] = json.loads(json.dumps(config.to_dict(), default=default))
    return data


def snippet(config: LoraConfig) -> str:
    """The LoraConfig as python a user can paste in front of get_peft_model."""
    fields = {
        "r": config.r,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": config.lora_dropout,
        "target_modules": sorted(config.target_modules or []),
        "target_parameters": list(config.target_parameters or []) or None,
        "rank_pattern": config.rank_pattern or None,
        "alpha_pattern": config.alpha_pattern or None,
        "bias": config.bias,
        "task_type": "CAUSAL_LM",
    }
    args = "".join(f"    {k}={v!r},\n" for k, v in fields.items() if v is not None)
    return (
        "from peft import LoraConfig, get_peft_model\n\n"
        f"config = LoraConfig(\n{args})\n"
        "model = get_peft_model(model, config)\n"
    )


def _require_full_coverage(report: CoverageReport, spec: ModelSpec, lora: LoraArgs) -> None:
    if report.expected and report.coverage == 1.0 and not _unrequested_router(report):
        return
    if _unrequested_router(report):
        cause = f"{spec.name}: the router got LoRA/training although it was not requested"
    elif not report.expected:
        cause = f"{spec.name}: none of the requested targets exists in the model"
    else:
        cause = (
            f"{spec.name}: only {report.adapted}/{report.expected} requested targets got LoRA "
            f"({report.coverage:.0%}); missed: {report.missed_summary()}"
        )
    if report.unresolved:
        fix = f"moetune's {spec.model_type} module paths are wrong here: please report it"
    elif lora.expert_mapping == "automap":
        fix = "use lora.expert_mapping=explicit: peft's name mapping misses these targets"
    else:
        fix = "report this model: peft did not wrap targets moetune named"
    raise RecipeError(cause, fix)


def _unrequested_router(report: CoverageReport) -> bool:
    return report.router_adapted and "router" not in report.kinds


def make_recipe(spec: ModelSpec, lora: LoraArgs) -> Recipe:
    """Build, apply (on meta) and audit the peft recipe; RecipeError unless it covers 100 %
    of the requested targets and leaves an unrequested router frozen."""
    config = build_peft_config(spec, lora)
    wrapped, notes = apply_peft(build_model(spec, device="meta"), config)
    report = audit_coverage(wrapped, spec, lora)
    _require_full_coverage(report, spec, lora)
    return Recipe(
        stack="peft",
        peft_config=config_dict(config),
        snippet=snippet(config),
        coverage=report,
        trainable_params=report.trainable_params,
        trainable_fraction=report.trainable_fraction,
        peft_warnings=notes,
    )
