"""`train.strategy ep`, refused in the launcher before any rank starts where it cannot run
(each rank would otherwise fail after loading the base, with a trace per rank).

What moetune's expert parallelism trains (engine/expert_parallel.py): LoRA through split
LoRA (lora.engine moetune) on a model with routed experts, E/N contiguous experts per rank,
experts in bf16 / the checkpoint's float dtype. Not built yet, so refused rather than
run another way: int8 / NF4 and published (stored) expert stacks, full fine-tuning and
expert selection under ep.
"""

from __future__ import annotations

from moetune.config import RunConfig
from moetune.model import load_spec
from moetune.train.distributed.nodes import world
from moetune.train.errors import TrainError


def check_expert_parallel(cfg: RunConfig) -> None:
    """Refuse an ep launch moetune cannot run exactly; one line, before any rank starts."""
    if cfg.train.strategy != "ep" or world(cfg.train) == 1:
        return
    # lazy: heavy to import (transformers, through the spec and the engine)
    from moetune.engine.expert_parallel import check_divides
    from moetune.engine.resolve import resolve_engine, stored_experts

    spec = load_spec(cfg.model.id, cfg.model.trust_remote_code)
    if not spec.is_moe or not spec.num_experts:
        raise TrainError(
            f"train.strategy ep places routed experts, and {spec.name} has none",
            "use train.strategy ddp or fsdp for a dense model",
        )
    _check_supported(cfg, stored_experts(spec, cfg.model.quantized_base) is not None)
    engine = resolve_engine(spec, cfg.lora, cfg.model.experts_dtype, cfg.model.quantized_base)
    if engine != "moetune":
        raise TrainError(
            "train.strategy ep runs the experts' LoRA through split LoRA, and this run resolves "
            f"lora.engine to {engine} (peft's wrappers would see only this rank's experts)",
            "set lora.engine: moetune (or auto) with experts in lora.targets, "
            "or train.strategy fsdp",
        )
    check_divides(spec.num_experts, world(cfg.train))
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


def _check_supported(cfg: RunConfig, stored: bool) -> None:
    """What ep does not build yet: refused, never trained another way."""
    asks = {
        f"experts_dtype {cfg.model.experts_dtype}": cfg.model.experts_dtype != "bf16",
        "a base stored quantised (FP8 / FP4 / INT4)": stored,
        "train.tuning full": cfg.train.tuning == "full",
        f"lora.expert_selection {cfg.lora.expert_selection}": cfg.lora.expert_selection != "all",
    }
    for what, asked in asks.items():
        if asked:
            raise TrainError(
                f"train.strategy ep does not train with {what} yet",
                "use train.strategy fsdp (every experts dtype), or ep with bf16 LoRA experts",
            )
