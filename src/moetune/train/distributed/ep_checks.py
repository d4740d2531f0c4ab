"""`train.strategy ep`, refused in the launcher before any rank starts where it cannot run
(each rank would otherwise fail after loading the base, with a trace per rank).

What moetune's expert parallelism trains (engine/expert_parallel.py): LoRA through split
LoRA (lora.engine moetune) on a model with routed experts, E/N contiguous experts per rank,
in every experts dtype – bf16 / the checkpoint's float dtype, int8 / NF4 quantised per rank,
and a base published quantised (FP8 / MXFP4 / NVFP4 / INT4 / GPTQ / AWQ) kept as stored –
each rank reading only its own experts' bytes (engine/ep_load.py). Not built yet, so
refused rather than run another way: full fine-tuning and expert selection under ep.
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
    from moetune.engine.resolve import resolve_engine

    spec = load_spec(cfg.model.id, cfg.model.trust_remote_code)
    if not spec.is_moe or not spec.num_experts:
        raise TrainError(
            f"train.strategy ep places routed experts, and {spec.name} has none",
            "use train.strategy ddp or fsdp for a dense model",
        )
    _check_supported(cfg)
    engine = resolve_engine(spec, cfg.lora, cfg.model.experts_dtype, cfg.model.quantized_base)
    if engine != "moetune":
        raise TrainError(
            "train.strategy ep runs the experts' LoRA through split LoRA, and this run resolves "
            f"lora.engine to {engine} (peft's wrappers would see only this rank's experts)",
            "set lora.engine: moetune (or auto) with experts in lora.targets, "
            "or train.strategy fsdp",
        )
    check_divides(spec.num_experts, world(cfg.train))


def _check_supported(cfg: RunConfig) -> None:
    """What ep does not build yet: refused, never trained another way."""
    asks = {
        "train.tuning full": cfg.train.tuning == "full",
        f"lora.expert_selection {cfg.lora.expert_selection}": cfg.lora.expert_selection != "all",
    }
    for what, asked in asks.items():
        if asked:
            raise TrainError(
                f"train.strategy ep does not train with {what} yet",
                "use train.strategy fsdp, or ep with LoRA on every expert",
            )
