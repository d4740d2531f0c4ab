"""Serving traps: an adapter that trained fine and then is refused, dropped or slow where it
is served. They speak when `output.serve_with` names the stack and the LoRA reaches the
experts (the default config serves nothing, so it stays quiet)."""

from __future__ import annotations

import moetune.lint.probes.serve as probes_serve
from moetune.config.keys import lora_stack
from moetune.lint.registry import Hit, LintContext, register_rule
from moetune.model.families.serving import GGUF_FAMILIES, VLLM_FAMILIES


def _serves_experts(ctx: LintContext, stack: str) -> bool:
    cfg = ctx.config
    return (
        stack in cfg.output.serve_with
        and "experts" in cfg.lora.targets
        and lora_stack(cfg.lora.stack).peft_adapter
        and ctx.is_moe
    )


@register_rule(
    "SERVE-VLLM-3D",
    "error",
    "vLLM refuses (or ignores) peft's fused expert adapter for this family",
    probe=probes_serve.vllm_2d_wrapper,
    libraries=("vllm",),
)
def vllm_3d(ctx: LintContext) -> Hit | None:
    if not _serves_experts(ctx, "vllm") or ctx.spec is None:
        return None
    family = VLLM_FAMILIES.get(ctx.spec.model_type)
    if family is None or family.experts == "3d":
        return None
    if family.experts == "ignored":
        return Hit(
            f"vLLM's {family.vllm_class} ignores expert LoRA ({family.why}): served, the "
            "fine-tune is lost without an error",
            "serve the merged model: moetune export RUN --format merged --out DIR",
            "output.serve_with",
        )
    return Hit(
        f"vLLM serves {ctx.spec.model_type} with a 2-D MoE LoRA wrapper: peft's fused 3-D "
        "expert adapter fails the first request ('contains fused 3D MoE weights')",
        "moetune export RUN --format vllm --out DIR writes the per-expert layout it reads "
        "(or start vLLM with --enable-mixed-moe-lora-format and is_3d_lora_weight=True)",
        "output.serve_with",
        severity="warn",
    )


@register_rule(
    "SERVE-GGUF-CONVERTER",
    "warn",
    "llama.cpp's convert_lora_to_gguf.py stops on expert LoRA",
    probe=probes_serve.stock_gguf_converter,
    libraries=("llama.cpp",),
)
def gguf_converter(ctx: LintContext) -> Hit | None:
    if not _serves_experts(ctx, "llama.cpp"):
        return None
    mapped = ctx.spec is None or ctx.spec.model_type in GGUF_FAMILIES
    fix = (
        "moetune export RUN --format gguf --out DIR (stacked ffn_*_exps LoRA llama.cpp "
        "applies), or --format merged and convert_hf_to_gguf.py"
        if mapped
        else "moetune export RUN --format merged --out DIR and convert it with llama.cpp's "
        "convert_hf_to_gguf.py (--format gguf has no tensor mapping for this family)"
    )
    return Hit(
        "llama.cpp's convert_lora_to_gguf.py raises 'Unprocessed experts' on peft's expert "
        "stacks; an attention-only GGUF LoRA loses the fine-tune",
        fix,
        "output.serve_with",
    )


@register_rule(
    "SERVE-UNMERGED-EXPERTS",
    "info",
    "unmerged peft expert LoRA computes ΔW for every expert at inference",
    probe=probes_serve.unmerged_expert_stack,
    libraries=("peft",),
)
def unmerged(ctx: LintContext) -> Hit | None:
    if not _serves_experts(ctx, "peft"):
        return None
    return Hit(
        "serving the unmerged adapter with peft materialises W + s·B@A for the whole expert "
        "stack on every forward (all experts, whatever the routing): slower, more memory",
        "moetune export RUN --format merged --out DIR and serve the merged checkpoint",
        "output.serve_with",
    )
