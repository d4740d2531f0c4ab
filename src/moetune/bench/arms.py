"""GM-1's sizes and arms, and the parameter matching between them.

The reference shape is the top-1 MoE of a size (E experts of width `expert_ffn` in every
layer). Its active parameters per token, counted by moetune's own ModelSpec (routed experts
scaled by top-k / E, routers, attention, norms and embeddings counted in full), fix the
dense model's intermediate width; every other arm is solved against the dense model:
the top-2 MoE's expert width so its *active* count matches, the matched-total MoE's so its
*total* count matches. Counts are affine in a width, so two counts give the exact solution;
the rounded width is counted again and must land within MATCH_TOLERANCE.

Top-1 arms keep the router's raw softmax weight (`norm_topk_prob` off, as Switch does):
renormalising one weight makes it exactly 1, and the router would then get no gradient
from the language-model loss at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from moetune.bench.corpus import vocab_size
from moetune.demo.tokenizer import BOS, EOS, PAD, vocabulary
from moetune.errors import ConfigError
from moetune.model import ModelSpec, spec_from_config

MATCH_TOLERANCE = 0.02  # matched counts must agree within 2 %


class BenchError(ConfigError):
    """A bench option cannot be run as asked (unknown size or arm, bad budget)."""


class Size(BaseModel):
    """One bench size: the models' shape and the default training budget."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden: int = Field(description="Hidden size of every arm.")
    layers: int = Field(description="Decoder layers (every layer of an MoE arm is MoE).")
    heads: int = Field(description="Attention heads (head_dim = hidden / heads).")
    kv_heads: int = Field(description="Key/value heads (grouped-query attention).")
    experts: int = Field(description="Routed experts per MoE layer.")
    expert_ffn: int = Field(description="Expert width of the reference top-1 MoE.")
    seq: int = Field(description="Tokens per packed training row.")
    batch: int = Field(description="Rows per optimizer step.")
    steps: int = Field(description="Default optimizer steps per arm and seed.")
    lr: float = Field(description="Peak AdamW learning rate (warmup, then cosine to 10 %).")
    evals: int = Field(description="Held-out evaluations per run besides the one at init.")
    eval_rows: int = Field(description="Held-out rows (of `seq` tokens) per evaluation.")


SIZES: dict[str, Size] = {
    "tiny": Size(hidden=32, layers=2, heads=2, kv_heads=1, experts=4, expert_ffn=48, seq=32,
                 batch=8, steps=40, lr=3e-3, evals=2, eval_rows=16),
    "small": Size(hidden=128, layers=4, heads=4, kv_heads=2, experts=8, expert_ffn=448,
                  seq=64, batch=16, steps=160, lr=2e-3, evals=4, eval_rows=64),
    "medium": Size(hidden=256, layers=6, heads=8, kv_heads=4, experts=8, expert_ffn=768,
                   seq=128, batch=16, steps=1500, lr=1e-3, evals=10, eval_rows=128),
    "large": Size(hidden=512, layers=8, heads=8, kv_heads=4, experts=16, expert_ffn=1024,
                  seq=256, batch=16, steps=4000, lr=6e-4, evals=10, eval_rows=128),
}  # fmt: skip
DEFAULT_SIZE = "small"  # ~6 M parameters in the top-1 MoE (the founding result's scale)


@dataclass(frozen=True)
class Arm:
    """One contender: dense (top_k 0) or an MoE matched to the dense model by `match`."""

    name: str
    description: str
    top_k: int
    match: Literal["reference", "active", "total"]
    aux_coef: float = 0.0  # load-balancing aux loss weight (the "governor")


ARMS: dict[str, Arm] = {}


def register(arm: Arm) -> Arm:
    ARMS[arm.name] = arm
    return arm


register(Arm("dense", "dense Qwen3, width solved to the top-1 MoE's active count", 0, "reference"))
register(Arm("moe-top1", "Qwen3-MoE top-1: the reference shape", 1, "active"))
register(Arm("moe-top2", "Qwen3-MoE top-2, expert width solved to match active", 2, "active"))
register(Arm("moe-matched-total", "Qwen3-MoE top-1, width solved to match total", 1, "total"))
register(Arm("moe-top1-aux", "moe-top1 with a load-balancing aux loss (governor)", 1,
             "active", aux_coef=0.01))  # fmt: skip
DEFAULT_ARMS = ("dense", "moe-top1", "moe-top2", "moe-matched-total")


def get_size(name: str) -> Size:
    if name not in SIZES:
        raise BenchError(f"unknown bench size {name!r}", f"use one of {', '.join(SIZES)}")
    return SIZES[name]


def get_arms(names: list[str]) -> list[Arm]:
    """The arms to train, dense first and always (every gap is measured against it)."""
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        raise BenchError(f"unknown arm {unknown[0]!r}", f"use some of {', '.join(ARMS)}")
    return [ARMS[n] for n in dict.fromkeys(["dense", *names])]


def config_dict(size: Size, top_k: int, width: int, aux_coef: float = 0.0) -> dict[str, Any]:
    """The config.json of one arm: dense qwen3 when `top_k` is 0, else qwen3_moe."""
    vocab = vocabulary()
    cfg: dict[str, Any] = {
        "hidden_size": size.hidden,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads,
        "head_dim": size.hidden // size.heads,
        "vocab_size": vocab_size(),
        "max_position_embeddings": size.seq,
        "tie_word_embeddings": True,
        "pad_token_id": vocab[PAD],
        "eos_token_id": vocab[EOS],
        "bos_token_id": vocab[BOS],
        "intermediate_size": width,
    }
    if not top_k:
        return {"model_type": "qwen3", **cfg}
    moe = {"num_experts": size.experts, "num_experts_per_tok": top_k,
           "moe_intermediate_size": width, "norm_topk_prob": top_k > 1,
           "router_aux_loss_coef": aux_coef}  # fmt: skip
    return {"model_type": "qwen3_moe", **cfg, **moe}


@lru_cache(maxsize=256)
def _counts(size: Size, top_k: int, width: int) -> tuple[int, int]:
    spec = spec_from_config(config_dict(size, top_k, width), f"gm1-k{top_k}-w{width}")
    return spec.total_params, spec.active_params


def solve_width(size: Size, top_k: int, target: int, count: Literal["active", "total"]) -> int:
    """The width whose `count` (active or total parameters) is nearest `target`."""
    pick = 1 if count == "active" else 0
    c1, c2 = _counts(size, top_k, 1)[pick], _counts(size, top_k, 2)[pick]
    width = max(1, round(1 + (target - c1) / (c2 - c1)))
    got = _counts(size, top_k, width)[pick]
    if abs(got - target) > MATCH_TOLERANCE * target:
        raise BenchError(
            f"cannot match {count} parameters ({target:,}) with a top-{top_k} width: "
            f"the nearest, {width}, gives {got:,}",
            "choose a size whose expert width is larger than its router and attention",
        )
    return width


@dataclass(frozen=True)
class Built:
    """One arm, sized: its config.json, width and exact counts (moetune's ModelSpec)."""

    arm: Arm
    width: int
    config: dict[str, Any]
    spec: ModelSpec

    def to_json(self, dense: Built) -> dict[str, Any]:
        return {
            "model_type": self.spec.model_type,
            "top_k": self.arm.top_k,
            "experts": self.spec.num_experts,
            "width": self.width,
            "total_params": self.spec.total_params,
            "active_params": self.spec.active_params,
            "active_vs_dense_pct": _pct(self.spec.active_params, dense.spec.active_params),
            "total_vs_dense_pct": _pct(self.spec.total_params, dense.spec.total_params),
            "aux_coef": self.arm.aux_coef,
        }


def _pct(value: int, ref: int) -> float:
    return round(100 * (value - ref) / ref, 3)


def size_arms(size: Size, arms: list[Arm]) -> dict[str, Built]:
    """Every arm sized against the dense model (built too, as the reference)."""
    reference_active = _counts(size, 1, size.expert_ffn)[1]
    dense_width = solve_width(size, 0, reference_active, "active")
    dense_total = _counts(size, 0, dense_width)[0]
    out: dict[str, Built] = {}
    for arm in [ARMS["dense"], *arms]:
        if arm.match == "reference":
            width = dense_width
        elif arm.match == "total":
            width = solve_width(size, arm.top_k, dense_total, "total")
        elif arm.top_k == 1:
            width = size.expert_ffn
        else:
            width = solve_width(size, arm.top_k, dense_total, "active")
        cfg = config_dict(size, arm.top_k, width, arm.aux_coef)
        out[arm.name] = Built(arm, width, cfg, spec_from_config(cfg, f"gm1-{arm.name}"))
    return out
