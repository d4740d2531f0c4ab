"""The mlx-lm recipe: a `mlx_lm.lora --config` YAML whose keys reach the expert stacks.

mlx-lm takes LoRA settings only from YAML (`lora_parameters`), matches `keys` exactly
against layer-relative module names (so HF names such as `mlp.experts.0.up_proj` match
nothing, silently), adapts only the last `num_layers` layers (default 16; -1 is all),
and without `keys` adapts every Linear – the router included. Its `scale` multiplies
B·A directly, so peft's alpha maps to scale = alpha / rank. Supplying
`lora_parameters` without all of rank, scale and dropout raises KeyError in mlx-lm,
hence all four keys are always written. That one rank applies to every key (mlx-lm's
`linear_to_lora_layers`), so a separate expert rank cannot be expressed.
"""

from __future__ import annotations

from typing import Any

import yaml

from moetune.config import LoraArgs
from moetune.errors import RecipeError
from moetune.model.families import Family, get_family
from moetune.model.spec import ModelSpec
from moetune.recipe.audit import PARTS, absent_reason, requested_kinds

# Fields mlx_lm.lora needs besides lora_parameters for a LoRA run over every layer.
MLX_RUN_FIELDS: dict[str, Any] = {
    "train": True,
    "fine_tune_type": "lora",
    "num_layers": -1,  # mlx-lm's default (16) would leave the first layers untouched
    "adapter_path": "adapters",
}


def _mlx_family(spec: ModelSpec) -> Family:
    family = get_family(spec.model_type)
    if not family.mlx_supported:
        raise RecipeError(
            f"{spec.name}: moetune has no mlx-lm recipe for the {family.model_type} family",
            "use lora.stack=peft, or check mlx-lm's model file and add the family's mlx paths",
        )
    return family


def _check_expert_rank(lora: LoraArgs) -> None:
    if lora.experts_rank != lora.rank:
        raise RecipeError(
            f"lora.expert_rank={lora.expert_rank} cannot be expressed for mlx-lm: its "
            "lora_parameters.rank applies to every key, experts included",
            "drop lora.expert_rank (or set lora.rank to the one rank you want), "
            "or use lora.stack=peft",
        )


def _check_kinds(spec: ModelSpec, kinds: tuple[str, ...]) -> None:
    if "router" in kinds:
        raise RecipeError(
            "the mlx recipe never adapts the router (routing would drift; deepseek's MoEGate "
            "is not even a Linear)",
            "drop 'router' from lora.targets and set lora.train_router=false for lora.stack=mlx",
        )
    if "experts" in kinds and not spec.is_moe:
        raise RecipeError(
            f"model {spec.name} is dense: it has no experts",
            "drop 'experts' from lora.targets",
        )


def mlx_keys(spec: ModelSpec, lora: LoraArgs) -> tuple[list[str], dict[str, str]]:
    """(lora_parameters.keys, kind -> why the model has none) for the requested targets."""
    kinds = requested_kinds(lora)
    _check_kinds(spec, kinds)
    family = _mlx_family(spec)
    paths = family.paths_of(spec)
    keys: list[str] = []
    absent: dict[str, str] = {}
    for kind in kinds:
        part, reason = PARTS[kind], absent_reason(kind, spec)
        if reason:
            absent[kind] = reason
            continue
        if not part.mlx(paths):
            raise RecipeError(
                f"{spec.name}: moetune does not know mlx-lm's names for the {part.label} "
                f"of {family.model_type}",
                f"drop '{kind}' from lora.targets or use lora.stack=peft",
            )
        keys += part.mlx(paths)
    return _without_router(list(dict.fromkeys(keys)), paths.mlx_router), absent


def _without_router(keys: list[str], router: tuple[str, ...]) -> list[str]:
    """Guard: a family table whose paths overlap the router must not leak it into keys."""
    leaked = [k for k in keys if k in router]
    if leaked:
        raise RecipeError(
            f"mlx keys {', '.join(leaked)} name the router",
            "fix the family's mlx paths in moetune.model",
        )
    return keys


def make_mlx_recipe(spec: ModelSpec, lora: LoraArgs) -> dict[str, Any]:
    """The mlx_lm.lora config for `lora` on `spec` (dict; see `mlx_yaml` for the text)."""
    _check_expert_rank(lora)
    keys, absent = mlx_keys(spec, lora)
    if not keys:
        raise RecipeError(
            f"{spec.name}: none of lora.targets ({', '.join(lora.targets)}) exists in this model",
            "pick targets the model has (attention is always a safe start)",
        )
    config: dict[str, Any] = {"model": spec.name, **MLX_RUN_FIELDS}
    config["lora_parameters"] = {
        "rank": lora.rank,
        "scale": lora.effective_alpha / lora.rank,
        "dropout": lora.dropout,
        "keys": keys,
    }
    return {"stack": "mlx", "config": config, "yaml": mlx_yaml(config), "not_present": absent}


def mlx_yaml(config: dict[str, Any]) -> str:
    """YAML text for `mlx_lm.lora --config`, with a header saying how to run it."""
    header = "# mlx_lm.lora --config this.yaml --data <dir with train.jsonl, valid.jsonl>\n"
    return header + yaml.safe_dump(config, sort_keys=False)
