"""Rules for the peft/transformers stack: adapters that silently miss (or break on) experts."""

from __future__ import annotations

from moetune.config.keys import lora_stack, splits
from moetune.errors import RecipeError
from moetune.lint.probes import peft as probes
from moetune.lint.registry import Hit, LintContext, Severity, register_rule
from moetune.plan.recommend import refuses_checkpointing
from moetune.recipe.targets import peft_name_map
from moetune.units import count, gib

PEFT_LIBS = ("peft", "transformers")
# bnb bytes per quantized Linear parameter (4-bit absmax overhead is ~3 %, left out).
BNB_BYTES = {"bnb-4bit": 0.5, "bnb-8bit": 1.0}
FP32, BF16 = 4, 2


def peft_maps_experts(ctx: LintContext) -> bool | None:
    """Whether the installed peft turns some target_modules names (gate/up/down_proj, or
    mixtral's w1/w2/w3) into the fused expert parameters; None without a spec."""
    if ctx.spec is None:
        return None

    mapping = peft_name_map(ctx.spec.model_type)
    return any(not new.endswith(".weight") for new in mapping.values())  # .weight: router


def _peft_experts(ctx: LintContext) -> bool:
    lora = ctx.config.lora
    return lora_stack(lora.stack).peft_adapter and "experts" in lora.targets and ctx.is_moe


def _automap(ctx: LintContext) -> bool:
    lora = ctx.config.lora
    return lora_stack(lora.stack).peft_adapter and lora.expert_mapping == "automap"


# -- MOE-LORA-DROPOUT --------------------------------------------------------------------


def _param_wrapped(ctx: LintContext) -> list[str]:
    """Requested parts peft adapts through target_parameters (lora.ParamWrapper)."""
    lora, spec = ctx.config.lora, ctx.spec
    wrapped = ["experts"] if "experts" in lora.targets and ctx.is_moe else []
    if "router" in lora.targets and ctx.is_moe:
        wrapped.append("router")  # TopKRouter modules are not nn.Linear: reached via .weight
    mlps = {"dense", "shared"} & set(lora.targets)
    if spec is not None and mlps and lora.expert_mapping == "explicit":
        present = {"dense": bool(spec.dense_layers), "shared": spec.num_shared_experts > 0}
        mlps = {m for m in mlps if present[m]}
        # the recipe moves MLP names peft would rewrite to target_parameters (`….weight`)
        if mlps and peft_maps_experts(ctx):
            wrapped += sorted(mlps)
    return wrapped


@register_rule(
    "MOE-LORA-DROPOUT",
    "error",
    "LoRA dropout with experts targeted (peft refuses it)",
    probe=probes.moe_lora_dropout,
    libraries=("peft",),
)
def lora_dropout(ctx: LintContext) -> Hit | None:
    dropout = ctx.config.lora.dropout
    if not lora_stack(ctx.config.lora.stack).peft_adapter or dropout == 0 or splits(_engine(ctx)):
        return None
    wrapped = _param_wrapped(ctx)
    if not wrapped:
        return None
    return Hit(
        f"peft stops with `ValueError: {probes.PEFT_DROPOUT_TEXT}.` when it builds the "
        f"adapter: lora.dropout={dropout} while {', '.join(wrapped)} go through "
        "target_parameters",
        "set lora.engine: moetune (split LoRA applies expert dropout), or lora.dropout: 0",
        "lora.dropout",
    )


# -- MOE-4BIT-BNB --------------------------------------------------------------------------


def _bnb_mode(ctx: LintContext) -> str | None:
    train = ctx.config.train
    if train.quantization != "none":
        return train.quantization
    return "bnb-4bit" if train.tuning == "qlora" else None


def _kbit_frozen_bytes(ctx: LintContext, mode: str) -> tuple[int, int]:
    """(frozen bytes after bnb + kbit prep, frozen bytes as plain bf16) for the spec."""
    assert ctx.spec is not None
    parts = ctx.spec.components
    linear = parts.attention + parts.dense_mlp + parts.shared_experts  # what bnb converts
    rest = ctx.spec.total_params - linear  # experts, embeddings, lm_head, norms: fp32 after prep
    return int(linear * BNB_BYTES[mode] + rest * FP32), ctx.spec.total_params * BF16


@register_rule(
    "MOE-4BIT-BNB",
    "error",
    "bitsandbytes QLoRA on an MoE leaves the experts bf16, then fp32",
    probe=probes.moe_4bit_bnb,
    libraries=("transformers", "peft", "bitsandbytes"),
)
def bnb_on_moe(ctx: LintContext) -> Hit | None:
    mode = _bnb_mode(ctx)
    if mode is None or ctx.spec is None or not ctx.spec.is_moe:
        return None
    kbit, bf16 = _kbit_frozen_bytes(ctx, mode)
    experts = ctx.spec.components.routed_experts
    share = 100 * experts / ctx.spec.total_params
    worse = kbit >= bf16
    return Hit(
        f"{mode} quantizes only nn.Linear: the fused experts ({count(experts)} params, "
        f"{share:.0f} %) stay bf16 and prepare_model_for_kbit_training upcasts them to fp32 – "
        f"frozen weights ≈ {gib(kbit)} vs {gib(bf16)} for bf16 LoRA",
        "train bf16 LoRA instead: train.tuning: lora, train.quantization: none "
        "(`moetune plan` shows which card fits)",
        "train.quantization" if ctx.config.train.quantization != "none" else "train.tuning",
        None if worse else "warn",
    )


# -- PEFT-AUTOMAP-DROPS-MLP -------------------------------------------------------------------


def _mlp_parts_lost(ctx: LintContext) -> list[str]:
    """Requested dense/shared MLPs that peft's remap strips from target_modules."""
    assert ctx.spec is not None
    spec, targets = ctx.spec, ctx.config.lora.targets
    lost = []
    if "dense" in targets and spec.dense_layers and spec.components.dense_mlp:
        lost.append(f"the dense MLP of {len(spec.dense_layers)} layer(s)")
    if "shared" in targets and spec.num_shared_experts and spec.components.shared_experts:
        lost.append(f"the shared experts of {len(spec.moe_layers)} MoE layers")
    return lost


@register_rule(
    "PEFT-AUTOMAP-DROPS-MLP",
    "error",
    "automap strips gate/up/down_proj: dense MLPs and shared experts get no LoRA",
    probe=probes.peft_automap_drops_mlp,
    libraries=PEFT_LIBS,
)
def automap_drops_mlp(ctx: LintContext) -> Hit | None:
    if not _automap(ctx) or not peft_maps_experts(ctx):
        return None
    lost = _mlp_parts_lost(ctx)
    if not lost:
        return None
    return Hit(
        "peft remaps the gate_proj/up_proj/down_proj names onto the fused experts and drops "
        f"them from target_modules, so {' and '.join(lost)} silently get no LoRA (peft #3711)",
        "set lora.expert_mapping: explicit (moetune's recipe sends names peft would rewrite "
        "through target_parameters, which peft leaves alone)",
        "lora.expert_mapping",
    )


# -- PEFT-QWEN2MOE-UNMAPPED ------------------------------------------------------------------


@register_rule(
    "PEFT-QWEN2MOE-UNMAPPED",
    "error",
    "qwen2_moe + automap: the routed experts get no LoRA",
    probe=probes.peft_qwen2moe_unmapped,
    libraries=PEFT_LIBS,
)
def qwen2moe_unmapped(ctx: LintContext) -> Hit | None:
    spec = ctx.spec
    if spec is None or spec.model_type != "qwen2_moe" or not _automap(ctx):
        return None
    if not _peft_experts(ctx) or peft_maps_experts(ctx):
        return None
    return Hit(
        f"peft {ctx.versions.get('peft', '?')} has no gate/up/down_proj mapping for qwen2_moe: "
        f"only mlp.shared_expert gets LoRA, the {spec.num_experts} routed experts in "
        f"{len(spec.moe_layers)} layers get none",
        "set lora.expert_mapping: explicit (target_parameters mlp.experts.gate_up_proj/down_proj)",
        "lora.expert_mapping",
    )


# -- LORA-ROUTER-TARGETED ---------------------------------------------------------------------


def _router_adapted(ctx: LintContext) -> bool:
    lora = ctx.config.lora
    if lora_stack(lora.stack).runs_mlx and lora.mlx_keys is not None and ctx.paths is not None:
        return bool(set(lora.mlx_keys) & set(ctx.paths.mlx_router))
    return "router" in lora.targets


@register_rule(
    "LORA-ROUTER-TARGETED",
    "warn",
    "the router gets LoRA although lora.train_router is off",
    probe=probes.lora_router_targeted,
    libraries=PEFT_LIBS,
)
def router_targeted(ctx: LintContext) -> Hit | None:
    if ctx.config.lora.train_router or not ctx.is_moe or not _router_adapted(ctx):
        return None
    field = "lora.mlx_keys" if lora_stack(ctx.config.lora.stack).runs_mlx else "lora.targets"
    return Hit(
        "the router gets LoRA while lora.train_router is false: routing drifts with no "
        "load-balancing loss to hold it, and expert load can collapse",
        f"remove the router from {field} (routers stay frozen), or set lora.train_router: true "
        "to train it on purpose with the aux loss on",
        field,
    )


# -- LORA-NO-EXPERTS ---------------------------------------------------------------------------


def _no_experts_reason(ctx: LintContext) -> tuple[str, str, str] | None:
    """(why, fix, field) when no adapter reaches an expert; None when one does."""
    lora, paths = ctx.config.lora, ctx.paths
    if lora_stack(lora.stack).runs_mlx and lora.mlx_keys is not None and paths is not None:
        if not set(lora.mlx_keys) & set(paths.mlx_experts):
            fix = f"add {', '.join(paths.mlx_experts)} to lora.mlx_keys"
            return "none of lora.mlx_keys names the expert stack", fix, "lora.mlx_keys"
        return None
    if "experts" not in lora.targets:
        return "lora.targets has no 'experts'", "add experts to lora.targets", "lora.targets"
    # qwen2_moe has its own rule (PEFT-QWEN2MOE-UNMAPPED); the peft lookup runs last
    spec = ctx.spec
    skip = spec is None or spec.model_type == "qwen2_moe" or not _automap(ctx)
    if not skip and peft_maps_experts(ctx) is False:
        assert spec is not None
        why = f"peft has no gate/up/down_proj mapping for {spec.model_type} (automap)"
        return why, "set lora.expert_mapping: explicit", "lora.expert_mapping"
    return None


@register_rule(
    "LORA-NO-EXPERTS",
    "warn",
    "no adapter reaches any expert of an MoE",
    probe=probes.lora_no_experts,
    libraries=PEFT_LIBS,
)
def no_experts(ctx: LintContext) -> Hit | None:
    if ctx.spec is None or not ctx.spec.is_moe:
        return None
    reason = _no_experts_reason(ctx)
    if reason is None:
        return None
    why, fix, field = reason
    experts = ctx.spec.components.routed_experts
    share = 100 * experts / ctx.spec.total_params
    # a mapping that cannot work is an error; leaving experts out may be a choice
    severity: Severity | None = "error" if field == "lora.expert_mapping" else None
    return Hit(
        f"{why}: the routed experts ({count(experts)} params, {share:.0f} % of the model) get "
        "no LoRA and the fine-tune reaches only what is around them",
        fix,
        field,
        severity,
    )


# -- QUANT-EXPERTS-PEFT ---------------------------------------------------------------------


@register_rule(
    "QUANT-EXPERTS-PEFT",
    "error",
    "quantised experts with peft's own experts path",
    probe=probes.quantized_experts_peft,
    libraries=PEFT_LIBS,
)
def quantized_experts_peft(ctx: LintContext) -> Hit | None:
    model = ctx.config.model
    if model.experts_dtype == "bf16" or splits(_engine(ctx)):
        return None
    return Hit(
        f"model.experts_dtype={model.experts_dtype} with lora.engine: peft – peft's "
        "target_parameters match no quantised stack, so the experts would get no LoRA, and "
        "its forward would rebuild every float stack",
        "set lora.engine: moetune (split LoRA dequantises one expert at a time)",
        "lora.engine",
    )


# -- ENGINE-MOETUNE-UNSERVED ------------------------------------------------------------------


def _engine(ctx: LintContext) -> str:
    """The engine the run resolves to; an unservable explicit moetune counts as asked."""
    if ctx.spec is None:
        return ctx.config.lora.engine
    # lazy: heavy to import (moetune.engine)
    from moetune.engine.resolve import resolve_engine

    try:
        model = ctx.config.model
        return resolve_engine(ctx.spec, ctx.config.lora, model.experts_dtype, model.quantized_base)
    except RecipeError:
        return "moetune"  # ENGINE-MOETUNE-UNSERVED reports it


@register_rule(
    "ENGINE-MOETUNE-UNSERVED",
    "error",
    "engine moetune on a family whose experts transformers does not dispatch",
    probe=probes.experts_not_dispatched,
    libraries=("transformers",),
)
def engine_unserved(ctx: LintContext) -> Hit | None:
    if ctx.spec is None or not splits(ctx.config.lora.engine):
        return None
    # lazy: heavy to import (moetune.engine)
    from moetune.engine.resolve import resolve_engine

    try:
        resolve_engine(ctx.spec, ctx.config.lora)
    except RecipeError as err:
        return Hit(err.cause, err.fix, "lora.engine")
    return None


# -- GC-UNSUPPORTED ----------------------------------------------------------------------------


@register_rule(
    "GC-UNSUPPORTED",
    "warn",
    "gradient checkpointing on a model class that refuses it",
    probe=probes.gradient_checkpointing_unsupported,
    libraries=("transformers",),
)
def gc_unsupported(ctx: LintContext) -> Hit | None:
    if ctx.spec is None or not ctx.config.train.gradient_checkpointing:
        return None
    refused = refuses_checkpointing(ctx.spec)
    if refused is None:
        return None
    return Hit(
        f"transformers stops with `ValueError: {refused} does not support activation "
        "checkpointing.` when a trainer turns it on: moetune trains and plans this model with "
        "checkpointing off, so every layer's activations stay live",
        "set train.gradient_checkpointing: false to say so, and plan the memory without it",
        "train.gradient_checkpointing",
    )
