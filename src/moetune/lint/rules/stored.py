"""Rules on bases published quantised (FP8 / MXFP4 / NVFP4 / INT4): trained as stored or not."""

from __future__ import annotations

from typing import Any

import moetune.lint.probes.stored as probes
from moetune.errors import MoetuneError
from moetune.lint.registry import Hit, LintContext, register_rule
from moetune.units import gib


def _stored(ctx: LintContext) -> tuple[Any, Any] | None:
    """(format, quantization_config) of the base as its spec read it, None for a float one,
    one not readable, or no spec (a GGUF base)."""
    # lazy: heavy to import (moetune.engine, torch)
    from moetune.engine.stored.formats import stored_format

    qcfg = ctx.spec.quant_config if ctx.spec is not None else None
    try:
        fmt = stored_format(qcfg)
    except MoetuneError:
        return None  # not readable here: the loader says why
    return None if fmt is None else (fmt, qcfg)


@register_rule(
    "QUANT-BASE-INFLATED",
    "warn",
    "a base published quantised, inflated to bf16 for training",
    probe=probes.transformers_inflates,
    libraries=("transformers",),
)
def quant_base_inflated(ctx: LintContext) -> Hit | None:
    found = _stored(ctx)
    if found is None or ctx.config.model.quantized_base == "as_stored":
        return None
    fmt, qcfg = found
    routed = ctx.spec.components.routed_experts if ctx.spec is not None else 0
    stored, inflated = routed * fmt.bytes_per_param(qcfg), routed * 2
    sizes = f" ({gib(stored)} stored -> {gib(inflated)})" if routed else ""
    return Hit(
        f"the base's experts are published as {fmt.label}; model.quantized_base: dequantize "
        f"inflates them to model.dtype{sizes}, and the adapter is trained on weights other "
        "than the ones vLLM / SGLang serve",
        "set model.quantized_base: as_stored (split LoRA over the stored bytes)",
        "model.quantized_base",
    )


def partial_fp8_widths(hf_config: dict[str, Any], block: tuple[int, int]) -> dict[str, int]:
    """The Linear widths of a config (out or in of some Linear) that `block` does not divide:
    the ones with a partial last block of scales."""
    get = hf_config.get
    widths = {name: get(name) for name in ("hidden_size", "intermediate_size",
                                            "moe_intermediate_size", "q_lora_rank")}  # fmt: skip
    if get("kv_lora_rank"):  # MLA: kv_a_proj_with_mqa's rows carry the rope dims too
        widths["kv_lora_rank + qk_rope_head_dim"] = get("kv_lora_rank") + get("qk_rope_head_dim", 0)
    return {n: w for n, w in widths.items() if isinstance(w, int) and w % min(block)}


@register_rule(
    "QUANT-FP8-PARTIAL-BLOCK",
    "warn",
    "a block-FP8 base with partial blocks, misread by transformers' FP8 loader",
    probe=probes.fp8_block_from_grid,
    libraries=("transformers",),
)
def quant_fp8_partial_block(ctx: LintContext) -> Hit | None:
    found = _stored(ctx)
    if found is None or ctx.spec is None or not hasattr(found[0], "block"):
        return None
    block = found[0].block
    partial = partial_fp8_widths(ctx.spec.hf_config, block)
    if not partial:
        return None
    named = ", ".join(f"{n} {w}" for n, w in partial.items())
    return Hit(
        f"the base is block FP8 ({block[0]}x{block[1]}) with widths that end in a partial "
        f"block ({named}); moetune reads it as DeepSeek's weight_dequant does, but "
        "transformers' FP8 loader takes the block from the scale grid and refuses these "
        "weights or scales them wrongly",
        "evaluate and serve the merged export (or the base with vLLM), never this base "
        "loaded through transformers' FP8 path",
        "model.id",
    )


@register_rule(
    "QUANT-BASE-LIBRARY",
    "error",
    "a base published quantised (bitsandbytes …) whose library is not installed",
    probe=probes.bnb_import_only_at_load,
    libraries=("transformers", "bitsandbytes"),
)
def quant_base_library(ctx: LintContext) -> Hit | None:
    qcfg = ctx.spec.quant_config if ctx.spec is not None else None
    if not qcfg:
        return None
    # lazy: heavy to import (moetune.engine, torch)
    from moetune.engine.stored.formats import missing_library, stored_format

    try:
        stored_format(qcfg)
    except MoetuneError as exc:
        if missing_library(qcfg):  # not an unreadable format: one library away from training
            return Hit(exc.cause, exc.fix, "model.id")
    return None
