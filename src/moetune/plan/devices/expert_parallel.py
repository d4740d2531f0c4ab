"""Expert parallelism, planned (moetune does not train with it): what each of N devices
would hold with the routed experts split across them (EP = N) and everything else
replicated, and which existing engines train that way.

From the single-device analytic peak: the routed expert stacks (as stored), their LoRA
factors, gradients and optimizer state (or, full fine-tuning, the experts' own) are
1/EP per device – ⌈E/EP⌉ experts each; attention, routers, shared experts, embeddings and
their adapters are replicated (an engine may further shard them with TP or FSDP, which
only lowers these figures). Every device runs its own micro-batch and receives its
experts' share of every device's tokens: balanced routing leaves the per-device expert
activations as on one device, plus the all-to-all dispatch and combine buffers of one
layer (top-k copies of each token's hidden state, in and out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from moetune.config import RunConfig
from moetune.errors import MoetuneError
from moetune.model.spec import ModelSpec
from moetune.plan.analytic import AnalyticEstimate
from moetune.plan.fit import analytic
from moetune.plan.layout import adapter_layout
from moetune.plan.offload.memory import layer_expert_bytes
from moetune.plan.step import DTYPE_BYTES

# Engines that train MoEs with expert parallelism today (moetune plans it only).
ENGINES = (
    "Megatron-Core (expert_model_parallel_size), through ms-swift (Megatron-SWIFT) or NVIDIA NeMo",
    "torchtitan (expert_parallel_degree, PyTorch-native)",
)
TRAINABLE = ("trainable_weights", "gradients", "optimizer_state", "optimizer_transients")


@dataclass(frozen=True)
class ExpertParallelPlan:
    """One device's bytes under EP = `ep`; `components` sum to `peak_bytes`."""

    ep: int
    experts_per_device: int
    components: dict[str, int]
    engines: tuple[str, ...] = ENGINES

    @property
    def peak_bytes(self) -> int:
        return sum(self.components.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "ep": self.ep,
            "experts_per_device": self.experts_per_device,
            "components": dict(self.components),
            "peak_bytes": self.peak_bytes,
            "engines": list(self.engines),
        }

    def describe(self) -> str:
        return (
            f"expert parallelism (EP = {self.ep}, {self.experts_per_device} experts per "
            f"device, the rest replicated) would hold {self.peak_bytes / 1024**3:.1f} GiB of "
            f"live tensors per device; engines that train with it: {'; '.join(self.engines)} "
            "– moetune plans it, it does not run it"
        )


def plan_expert_parallel(
    spec: ModelSpec, cfg: RunConfig, gpus: int, est: AnalyticEstimate | None = None
) -> ExpertParallelPlan | None:
    """Per-device bytes with the routed experts split over `gpus` (at most one expert per
    device: EP ≤ E); None for a dense model or a single device."""
    if gpus < 2 or not spec.is_moe:
        return None
    ep = min(gpus, spec.num_experts)
    est = est or analytic(spec, cfg)
    parts = dict(est.components)
    experts = _expert_weight_bytes(spec, cfg)
    share = _expert_trainable_share(spec, cfg, est.trainable_params)
    out = {
        "frozen_weights": parts.pop("frozen_weights", 0) - experts,  # replicated
        "expert_weights": -(-experts // ep),
    }
    for name in TRAINABLE:
        whole = parts.pop(name, 0)
        out[name] = round(whole * (1 - share) + whole * share / ep)
    out["expert_weight_copies"] = -(-parts.pop("expert_weight_copies", 0) // ep)
    out.update(parts)  # activations and logits: each device's own micro-batch
    out["all_to_all_buffers"] = _all_to_all(spec, cfg)
    return ExpertParallelPlan(ep, math.ceil(spec.num_experts / ep), out)


def _expert_weight_bytes(spec: ModelSpec, cfg: RunConfig) -> int:
    """Frozen routed stacks as stored (none under full fine-tuning: they are trainable)."""
    if cfg.train.tuning == "full":
        return 0
    try:
        return layer_expert_bytes(spec, cfg) * len(spec.moe_layers)
    except MoetuneError:
        return 0


def _expert_trainable_share(spec: ModelSpec, cfg: RunConfig, trainable: int) -> float:
    """The fraction of trainable parameters that live with the experts."""
    if not trainable:
        return 0.0
    if cfg.train.tuning == "full":
        return spec.components.routed_experts / trainable
    layout = adapter_layout(spec, cfg.lora)
    expert = sum(a.lora_numel for layer in layout.layers for a in layer if a.kind == "experts")
    return expert / trainable


def _all_to_all(spec: ModelSpec, cfg: RunConfig) -> int:
    """One layer's dispatch and combine receive buffers: top-k hidden states per token."""
    tokens = cfg.train.seq_len * cfg.train.batch_size
    return 2 * tokens * spec.top_k * spec.hidden_size * DTYPE_BYTES[cfg.model.dtype]
