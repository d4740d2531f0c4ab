"""The changes the recommendation search (`plan.recommend`) combines: on/off `MOVES`, the
frozen-expert `STORAGES`, and the quality cost of each (`COSTS`, the table in
`plan.recommend`'s docstring) – data the search walks, kept apart from the walk."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moetune.config import RunConfig
from moetune.config.keys import splits

COSTS: dict[str, float] = {  # see the table above; "dq": nf4 already, quantise its scales
    "qlora→lora": 0.0, "engine": 0.0, "dq": 0.0, "as_stored": 0.0, "explicit": 0.05,
    "gc": 0.1, "batch": 0.2,
    "int8": 0.25, "full→lora": 0.5, "nf4": 0.6, "expert_rank": 0.7, "rank": 1.0,
    "dense": 1.1, "shared": 1.2, "attention": 1.6, "seq": 2.0,
}  # fmt: skip


@dataclass(frozen=True)
class Move:
    """One on/off change to a config, with how to say it (its cost is COSTS[name])."""

    name: str
    apply: Callable[[RunConfig], RunConfig | None]  # None: does not apply
    says: Callable[[RunConfig, RunConfig], tuple[str, str]]  # (words, --set override)

    @property
    def cost(self) -> float:
        return COSTS[self.name]


def with_lora(cfg: RunConfig, **update: Any) -> RunConfig:
    return cfg.model_copy(update={"lora": cfg.lora.model_copy(update=update)})


def with_train(cfg: RunConfig, **update: Any) -> RunConfig:
    return cfg.model_copy(update={"train": cfg.train.model_copy(update=update)})


def with_model(cfg: RunConfig, **update: Any) -> RunConfig:
    return cfg.model_copy(update={"model": cfg.model.model_copy(update=update)})


def _drop(kind: str) -> Callable[[RunConfig], RunConfig | None]:
    def apply(cfg: RunConfig) -> RunConfig | None:
        if kind not in cfg.lora.targets or cfg.train.tuning == "full":
            return None
        if len(cfg.lora.targets) == 1:  # nothing would be left to train
            return None
        return with_lora(cfg, targets=[t for t in cfg.lora.targets if t != kind])

    return apply


def _targets_said(kind: str) -> Callable[[RunConfig, RunConfig], tuple[str, str]]:
    def says(_: RunConfig, new: RunConfig) -> tuple[str, str]:
        return f"drop LoRA on {kind}", f"lora.targets=[{','.join(new.lora.targets)}]"

    return says


MOVES: tuple[Move, ...] = (
    Move(
        "qlora→lora",
        lambda c: with_train(c, tuning="lora", quantization="none")
        if c.train.tuning == "qlora" or c.train.quantization != "none" else None,
        lambda o, n: ("bf16 LoRA instead of bitsandbytes (its fused experts end up fp32)",
                      "train.tuning=lora"),
    ),
    Move(
        "engine",
        lambda c: with_lora(c, engine="moetune")
        if not splits(c.lora.engine) and "experts" in c.lora.targets else None,  # + _usable_moves
        lambda o, n: ("engine moetune (split LoRA: same adapter, no W+ΔW copies)",
                      "lora.engine=moetune"),
    ),
    Move(  # the published values themselves: dequantised they are the same numbers
        "as_stored",
        lambda c: with_model(c, quantized_base="as_stored")
        if c.model.quantized_base == "dequantize" else None,  # + _usable_moves: a stored base
        lambda o, n: ("keep the routed experts as published (split LoRA over the stored bytes)",
                      "model.quantized_base=as_stored"),
    ),
    Move(
        "explicit",
        lambda c: with_lora(c, expert_mapping="explicit")
        if c.lora.expert_mapping == "automap" and c.train.tuning != "full" else None,
        lambda o, n: ("explicit expert targets (rank r on gate_up, not peft's 2r)",
                      "lora.expert_mapping=explicit"),
    ),
    Move(
        "gc",
        lambda c: with_train(c, gradient_checkpointing=True)
        if not c.train.gradient_checkpointing else None,
        lambda o, n: ("gradient checkpointing on (≈ 30 % slower, same result)",
                      "train.gradient_checkpointing=true"),
    ),
    Move(
        "batch",
        lambda c: with_train(c, batch_size=1) if c.train.batch_size > 1 else None,
        lambda o, n: (f"batch {o.train.batch_size} → 1 (keep the effective batch with gradient "
                      "accumulation)", "train.batch_size=1"),
    ),
    Move(
        "full→lora",
        lambda c: with_train(c, tuning="lora") if c.train.tuning == "full" else None,
        lambda o, n: ("LoRA instead of full fine-tuning", "train.tuning=lora"),
    ),
    Move("dense", _drop("dense"), _targets_said("dense")),
    Move("shared", _drop("shared"), _targets_said("shared")),
    Move("attention", _drop("attention"), _targets_said("attention")),
)  # fmt: skip


@dataclass(frozen=True)
class Storage:
    """How the frozen expert stacks are stored: one of these per candidate."""

    dtype: str
    double_quant: bool
    words: str


STORAGES = (  # leanest last
    Storage("int8", False, "int8 frozen experts (≈ 0.6 % output error)"),
    Storage("nf4", True, "NF4 + double-quant frozen experts (≈ 9 % output error)"),
)
LEVEL = {"bf16": 0, "int8": 1, "nf4": 2}
