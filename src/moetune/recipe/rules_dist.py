"""Rules for train.nproc > 1 (train/distributed.py): strategies accelerate cannot run here,
and engine features not validated under sharding, refused before any process starts."""

from __future__ import annotations

from importlib import util

from moetune.recipe import probes_dist
from moetune.recipe.rules import Hit, LintContext, register_rule

SHARDED = ("fsdp", "zero3")


def _sharded(ctx: LintContext) -> bool:
    t = ctx.config.train
    return t.nproc > 1 and t.strategy in SHARDED


def _on_cpu(ctx: LintContext) -> bool:
    device = ctx.config.train.device
    if device != "auto":
        return device == "cpu"
    import torch  # only for a sharded multi-process run

    return not torch.cuda.is_available()


@register_rule(
    "DIST-SHARDED-CPU",
    "error",
    "FSDP2 / ZeRO-3 requested for CPU processes, which accelerate runs as plain DDP",
    probe=probes_dist.fsdp_on_cpu,
    libraries=("accelerate", "torch"),
)
def sharded_cpu(ctx: LintContext) -> Hit | None:
    if not _sharded(ctx) or not _on_cpu(ctx):
        return None
    return Hit(
        f"train.strategy {ctx.config.train.strategy} on CPU processes: accelerate enters "
        "FSDP/DeepSpeed only on GPUs, so every CPU rank would hold the whole model (DDP)",
        "set train.strategy: ddp (--strategy ddp) on CPU; fsdp / zero3 need GPUs",
        "train.strategy",
    )


@register_rule(
    "DIST-DEEPSPEED-MISSING",
    "error",
    "train.strategy zero3 without the deepspeed package",
    probe=probes_dist.deepspeed_missing,
    libraries=("accelerate",),
)
def deepspeed_missing(ctx: LintContext) -> Hit | None:
    t = ctx.config.train
    if t.nproc == 1 or t.strategy != "zero3" or util.find_spec("deepspeed") is not None:
        return None
    return Hit(
        "train.strategy zero3 needs DeepSpeed, which is not installed: every rank fails at start",
        "pip install deepspeed on the GPU machine, or set train.strategy: fsdp",
        "train.strategy",
    )


def _engine_feature(ctx: LintContext) -> str | None:
    """What of moetune's engine the run uses that sharding was not validated with."""
    if ctx.config.model.experts_dtype != "bf16":
        return f"quantised experts (model.experts_dtype {ctx.config.model.experts_dtype})"
    if ctx.spec is None or "experts" not in ctx.config.lora.targets:
        return None
    from moetune.engine.resolve import resolve_engine

    if resolve_engine(ctx.spec, ctx.config.lora, ctx.config.model.experts_dtype) == "moetune":
        return "split LoRA (lora.engine moetune)"
    return None


@register_rule(
    "DIST-ENGINE-SHARDED",
    "error",
    "split LoRA or quantised experts under FSDP2 / ZeRO-3, not validated",
    probe=probes_dist.engine_sharded,
    libraries=("accelerate", "torch"),
)
def engine_sharded(ctx: LintContext) -> Hit | None:
    feature = _engine_feature(ctx) if _sharded(ctx) else None
    if feature is None:
        return None
    return Hit(
        f"{feature} with train.strategy {ctx.config.train.strategy}: its expert stacks were "
        "never validated sharded (only DDP, where every rank holds them whole, is tested)",
        "set train.strategy: ddp, or lora.engine: peft with model.experts_dtype: bf16",
        "train.strategy",
    )
