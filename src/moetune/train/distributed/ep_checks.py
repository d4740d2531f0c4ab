"""`train.strategy ep`, refused in the launcher before any rank starts where it cannot run
(each rank would otherwise fail after loading the base, with a trace per rank).

What moetune's expert parallelism trains (engine/expert_parallel.py): LoRA through split
LoRA (lora.engine moetune) on a model with routed experts, E/N contiguous experts per rank,
in every experts dtype – bf16 / the checkpoint's float dtype, int8 / NF4 quantised per rank,
and a base published quantised (FP8 / MXFP4 / NVFP4 / INT4 / GPTQ / AWQ) kept as stored –
each rank reading only its own experts' bytes (engine/ep_load.py). Expert selection runs:
every rank scores the same rows (so all agree on the choice) and trains the selected experts
it holds. Not built yet, so refused rather than run another way: full fine-tuning under ep.
"""

from __future__ import annotations

from moetune.config import RunConfig
from moetune.config.ep_split import check_ep_split, check_routed
from moetune.model import load_spec
from moetune.train.distributed.nodes import world
from moetune.train.errors import TrainError


def check_expert_parallel(cfg: RunConfig) -> None:
    """Refuse an ep launch moetune cannot run exactly; one line, before any rank starts."""
    asked = cfg.train.ep_degree is not None or cfg.train.ep_placement != "contiguous"
    if cfg.train.strategy != "ep" and asked and world(cfg.train) > 1:
        raise TrainError(
            f"train.ep_degree / ep_placement place experts, and train.strategy is "
            f"{cfg.train.strategy}",
            "set train.strategy ep, or leave train.ep_degree and ep_placement at their defaults",
        )
    if cfg.train.strategy != "ep" or world(cfg.train) == 1:
        return
    # lazy: heavy to import (transformers, through the engine)
    from moetune.engine.resolve import resolve_engine, stored_experts

    spec = load_spec(cfg.model.id, cfg.model.trust_remote_code)
    check_routed(spec.name, spec.num_experts if spec.is_moe else None)
    _check_supported(cfg)
    engine = resolve_engine(spec, cfg.lora, cfg.model.experts_dtype, cfg.model.quantized_base)
    if engine != "moetune":
        raise TrainError(
            "train.strategy ep runs the experts' LoRA through split LoRA, and this run resolves "
            f"lora.engine to {engine} (peft's wrappers would see only this rank's experts)",
            "set lora.engine: moetune (or auto) with experts in lora.targets, "
            "or train.strategy fsdp",
        )
    stored = stored_experts(spec, cfg.model.quantized_base) is not None
    if cfg.train.ep_degree is not None:  # groups of ep_degree ranks, the rest FSDP2
        _check_groups(cfg, stored)
        # lazy: heavy to import (torch.distributed)
        from moetune.train.distributed.ep_mesh import check_ep_degree

        check_ep_degree(cfg.train.ep_degree, world(cfg.train), None)  # this torch's FSDP2
    # the plan's checks (plan --strategy ep), in its words
    check_ep_split(spec.name, spec.num_experts, world(cfg.train), cfg.train.ep_degree)
    if cfg.train.ep_placement == "balanced":
        _check_balanced(cfg, stored)
    _check_one_forward(cfg)


def _check_one_forward(cfg: RunConfig) -> None:
    """Checkpointed, ep replays each forward's routing in its recompute, one forward per
    backward (ep_replay.py); GRPO's SFT term runs a second training forward before it."""
    t = cfg.train
    if t.method == "grpo" and t.grpo.sft_weight and t.gradient_checkpointing:
        raise TrainError(
            "train.strategy ep with gradient checkpointing replays each forward's routing in "
            "its recompute, and train.grpo.sft_weight adds a second training forward (the SFT "
            "term) before the backward",
            "set train.gradient_checkpointing: false, or train.grpo.sft_weight: 0",
        )


def _check_groups(cfg: RunConfig, stored: bool) -> None:
    """Expert groups with the rest under FSDP2 are built and proved for float experts only:
    FSDP2 would meet the quantised stacks' buffers and a stored Linear's stand-in weight."""
    if cfg.model.experts_dtype != "bf16" or stored:
        what = "a base kept as stored" if stored else f"experts_dtype {cfg.model.experts_dtype}"
        raise TrainError(
            f"train.ep_degree (expert groups, the rest FSDP2) does not run with {what} yet",
            "leave train.ep_degree unset (ep over every rank, the rest replicated)",
        )


def _check_balanced(cfg: RunConfig, stored: bool) -> None:
    """What train.ep_placement balanced needs, and what it does not combine with yet (it
    exchanges float stacks only: a quantised stack's buffers would stay where they were)."""
    asks = {
        "quantised or stored experts": cfg.model.experts_dtype != "bf16" or stored,
        "train.routing_every 0 (the base's routing it places by is not measured)":
            cfg.train.routing_every == 0,
        "train.ep_degree (FSDP2 shards the factors whole; a placement moves per-rank slices)":
            cfg.train.ep_degree is not None,
        "lora.expert_selection (its masks are in the base's expert order)":
            cfg.lora.expert_selection != "all",
    }  # fmt: skip
    for what, asked in asks.items():
        if asked:
            raise TrainError(
                f"train.ep_placement balanced does not run with {what}",
                "set train.ep_placement: contiguous, or drop that setting",
            )


def _check_supported(cfg: RunConfig) -> None:
    """What ep does not build yet: refused, never trained another way."""
    asks = {
        "train.tuning full": cfg.train.tuning == "full",
    }
    for what, asked in asks.items():
        if asked:
            raise TrainError(
                f"train.strategy ep does not train with {what} yet",
                "use train.strategy fsdp, or ep with LoRA on every expert",
            )
