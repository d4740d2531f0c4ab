"""Rules for the other stacks: mlx-lm (Apple silicon and Linux CPU) and GGUF bases."""

from __future__ import annotations

from pathlib import Path

import moetune.lint.probes.mlx as probes_mlx
from moetune.config.keys import lora_stack
from moetune.lint.mlx_env import MLX_INSTALL, backend_fix, mlx_backend, pin_problems
from moetune.lint.probes import model as probes
from moetune.lint.registry import Hit, LintContext, register_rule
from moetune.model.families.registry import ModulePaths
from moetune.model.weight_files import checkpoint_files

# Module names mlx-lm matches at model level (its second pass over model.named_modules()).
MLX_MODEL_LEVEL = ("lm_head", "model.embed_tokens")


def _is_mlx(ctx: LintContext) -> bool:
    return lora_stack(ctx.config.lora.stack).runs_mlx


def mlx_paths(p: ModulePaths) -> tuple[str, ...]:
    """Every module name mlx-lm can adapt in this family (layer-relative or model-level)."""
    layer = p.mlx_attention + p.mlx_experts + p.mlx_dense + p.mlx_shared + p.mlx_router
    return layer + MLX_MODEL_LEVEL


def suggested_mlx_keys(p: ModulePaths) -> list[str]:
    """Attention + expert stack: the keys that reach the experts and leave the router alone."""
    return [*p.mlx_attention, *p.mlx_experts]


@register_rule(
    "MLX-DEFAULT-KEYS",
    "warn",
    "mlx-lm without explicit keys adapts every Linear, router included",
    probe=probes_mlx.mlx_default_keys,
    libraries=("mlx-lm",),
)
def default_keys(ctx: LintContext) -> Hit | None:
    if not _is_mlx(ctx) or ctx.config.lora.mlx_keys is not None or not ctx.is_moe:
        return None
    example = suggested_mlx_keys(ctx.paths) if ctx.paths else ["self_attn.q_proj", "…"]
    return Hit(
        "mlx-lm with no lora_parameters.keys adapts every Linear/SwitchLinear/Embedding in the "
        "layers – the router included – so routing drifts",
        f"set lora.mlx_keys explicitly, e.g. {example}",
        "lora.mlx_keys",
    )


@register_rule(
    "MLX-KEYS-NO-MATCH",
    "error",
    "mlx-lm keys that match no module are silently ignored",
    probe=probes_mlx.mlx_keys_no_match,
    libraries=("mlx-lm",),
)
def keys_no_match(ctx: LintContext) -> Hit | None:
    keys, family, paths = ctx.config.lora.mlx_keys, ctx.family, ctx.paths
    if not _is_mlx(ctx) or not keys or family is None or paths is None:
        return None
    if not family.mlx_supported:
        return None  # mlx-lm cannot load this family at all; the mlx recipe says so
    unmatched = [k for k in keys if k not in mlx_paths(paths)]
    if not unmatched:
        return None
    hint = (
        " (HF per-expert names; mlx-lm stacks experts in switch_mlp)"
        if any(".experts." in k for k in unmatched)
        else ""
    )
    return Hit(
        f"{len(unmatched)} of {len(keys)} lora.mlx_keys match no {family.model_type} module in "
        f"mlx-lm and are ignored without a word: {unmatched[:4]}{hint}",
        f"use mlx-lm module names, e.g. {suggested_mlx_keys(paths)}",
        "lora.mlx_keys",
    )


@register_rule(
    "MLX-TRANSFORMERS-PIN",
    "error",
    "known-bad mlx-lm / transformers version combination",
    probe=probes_mlx.mlx_transformers_pin,
    libraries=("mlx-lm", "transformers"),
)
def transformers_pin(ctx: LintContext) -> Hit | None:
    if not _is_mlx(ctx):
        return None
    problems = pin_problems(ctx.versions)
    if not problems:
        return None
    installed = f"mlx-lm {ctx.versions['mlx-lm']}, transformers {ctx.versions.get('transformers')}"
    return Hit(
        f"{'; '.join(p.message for p in problems)} (installed: {installed}) – mlx_lm fails "
        "to import or load",
        "; ".join(p.fix for p in problems),
        None,
    )


@register_rule(
    "MLX-NO-BACKEND",
    "error",
    "mlx-lm installed without an mlx backend",
    probe=probes_mlx.mlx_no_backend,
    libraries=("mlx-lm",),
)
def no_backend(ctx: LintContext) -> Hit | None:
    if not _is_mlx(ctx):
        return None
    found = mlx_backend()
    if found.backend is not None:
        return None
    if found.mlx_lm is None:
        return Hit("lora.stack=mlx but mlx-lm is not installed", MLX_INSTALL, "lora.stack")
    return Hit(
        f"mlx-lm {found.mlx_lm} is installed without an mlx backend ({found.error}): "
        "`import mlx_lm` fails before training (plain `pip install mlx-lm` brings mlx only "
        "on macOS)",
        backend_fix(),
        "lora.stack",
    )


@register_rule(
    "GGUF-NOT-TRAINABLE",
    "error",
    "a GGUF base cannot be fine-tuned",
    probe=probes.gguf_not_trainable,
    libraries=("transformers",),
)
def gguf(ctx: LintContext) -> Hit | None:
    model = ctx.config.model
    if not model.is_gguf:
        return None
    return Hit(
        f"{model.id} is a GGUF (llama.cpp inference format): peft and mlx-lm cannot train it, "
        "and a dequantized GGUF is a lossy copy of the original weights",
        "set model.id to the original safetensors repo (e.g. Qwen/Qwen3-30B-A3B) and "
        "model.format: hf; then moetune export RUN --format gguf (llama.cpp's own "
        "convert_lora_to_gguf.py stops on expert LoRA)",
        "model.id",
    )


def fused_mlx_keys(model_id: str) -> list[str]:
    """Stacked `switch_mlp` expert tensors in a local checkpoint (an mlx_lm.fuse output)."""
    root = Path(model_id)
    if not root.is_dir():
        return []
    # lazy: heavy to import (safetensors)
    from safetensors import safe_open

    found: list[str] = []
    for path in checkpoint_files(root):
        try:
            with safe_open(str(path), "np") as fh:
                found += [k for k in fh.keys() if ".switch_mlp." in k]  # noqa: SIM118
        except Exception:  # an unreadable file is the loader's error to report
            continue
    return found


@register_rule(
    "MLX-FUSED-KEYS",
    "error",
    "an mlx_lm.fuse output loads in transformers with random experts",
    probe=probes_mlx.mlx_fused_keys,
    libraries=("transformers", "mlx-lm"),
)
def fused_keys(ctx: LintContext) -> Hit | None:
    if _is_mlx(ctx):  # mlx-lm reads its own layout
        return None
    stacked = fused_mlx_keys(ctx.config.model.id)
    if not stacked:
        return None
    return Hit(
        f"{ctx.config.model.id} holds mlx-lm's stacked expert tensors ({stacked[0]}, "
        f"{len(stacked)} in all): transformers loads it without an error but with every "
        "expert randomly initialised",
        "convert it first: moetune.export.mlx.fused_to_hf(FUSED_DIR, OUT_DIR) "
        "(or use lora.stack=mlx)",
        "model.id",
    )
