"""The mlx-lm recipe: a `mlx_lm.lora --config` YAML whose keys reach the expert stacks.

mlx-lm takes LoRA settings only from YAML (`lora_parameters`), matches `keys` exactly
against layer-relative module names (so HF names such as `mlp.experts.0.up_proj` match
nothing, silently), adapts only the last `num_layers` layers (default 16; -1 is all),
and without `keys` adapts every Linear – the router included. Its `scale` multiplies
B·A directly, so peft's alpha maps to scale = alpha / rank. Supplying
`lora_parameters` without all of rank, scale and dropout raises KeyError in mlx-lm,
hence all four keys are always written. That one rank applies to every key (mlx-lm's
`linear_to_lora_layers`), so a separate expert rank cannot be expressed.

The run's training hyperparameters go into the YAML too (`mlx_train_fields`): without a
`learning_rate` mlx-lm uses 1e-5, and a short run learns nothing. Notes are YAML
comments, so the printed text parses whatever the terminal width.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import yaml

from moetune.config import DataArgs, LoraArgs, TrainArgs
from moetune.errors import RecipeError
from moetune.model.families.registry import Family, get_family
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
    if lora.effective_expert_rank != lora.rank:
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


def mlx_iters(train: TrainArgs, rows: int | None) -> int | None:
    """Optimizer steps as the peft trainer counts them: max_steps, else epochs over `rows`."""
    if train.max_steps is not None:
        return train.max_steps
    if rows is None:
        return None
    per_step = train.batch_size * train.grad_accum
    return max(1, math.ceil(train.epochs * rows / per_step))


def mlx_schedule(train: TrainArgs, iters: int) -> dict[str, Any]:
    """train.lr_scheduler after train.warmup_ratio as mlx-lm's `lr_schedule` (its
    optimizers.schedulers by name; warmup is linear from 0, as in transformers)."""
    lr, warmup = train.learning_rate, math.ceil(train.warmup_ratio * iters)
    rest = max(1, iters - warmup)
    shapes = {
        "cosine": ("cosine_decay", [lr, rest, 0.0]),
        "linear": ("linear_schedule", [lr, 0.0, rest]),
        "constant": ("linear_schedule", [lr, lr, rest]),
    }
    name, arguments = shapes[train.lr_scheduler]
    return {"name": name, "arguments": arguments, "warmup": warmup, "warmup_init": 0.0}


def mlx_train_fields(
    train: TrainArgs, data: DataArgs, rows: int | None = None
) -> tuple[dict[str, Any], list[str]]:
    """mlx_lm.lora's fields for the run's hyperparameters, and notes on what it cannot take."""
    fields: dict[str, Any] = {
        "seed": train.seed,
        "batch_size": train.batch_size,
        "grad_accumulation_steps": train.grad_accum,
        "learning_rate": train.learning_rate,
        "optimizer": "adamw",
        "optimizer_config": {"adamw": {"weight_decay": train.weight_decay}},
        "max_seq_length": train.seq_len,
        "grad_checkpoint": train.gradient_checkpointing,
        "steps_per_report": train.logging_steps,
        "save_every": train.save_steps,
        "mask_prompt": data.completion_only_loss,  # loss on completions only
    }
    notes = []
    iters = mlx_iters(train, rows)
    if iters is None:
        notes.append("iters: mlx-lm's default (1000); set train.max_steps to choose")
    else:
        fields["iters"] = iters
        fields["lr_schedule"] = mlx_schedule(train, iters)
    return fields, notes


def make_mlx_recipe(
    spec: ModelSpec,
    lora: LoraArgs,
    train: TrainArgs | None = None,
    data: DataArgs | None = None,
    rows: int | None = None,
) -> dict[str, Any]:
    """The mlx_lm.lora config for `lora` on `spec`, with the hyperparameters of `train`
    (defaults when None; `rows`: training rows, for iters from epochs) as a dict and as
    YAML text (`mlx_yaml`)."""
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
    train, data = train or TrainArgs.model_validate({}), data or DataArgs.model_validate({})
    fields, notes = mlx_train_fields(train, data, rows)
    config |= fields
    notes += [f"{kind}: not present ({why})" for kind, why in absent.items()]
    return {
        "stack": "mlx",
        "config": config,
        "yaml": mlx_yaml(config, notes),
        "not_present": absent,
        "notes": notes,
    }


def mlx_yaml(config: dict[str, Any], notes: Sequence[str] = ()) -> str:
    """YAML text for `mlx_lm.lora --config`: a header saying how to run it, the notes as
    comments (one line each, never wrapped into the YAML), then the config."""
    lines = ["mlx_lm.lora --config this.yaml --data <dir with train.jsonl, valid.jsonl>"]
    lines += [f"note: {note}" for note in notes]
    header = "".join(f"# {' '.join(line.split())}\n" for line in lines)
    return header + yaml.safe_dump(config, sort_keys=False, width=10**6)
