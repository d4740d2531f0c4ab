"""Expert parallelism, planned per device: what each of N devices holds with the routed
experts split across them (EP = N) and everything else replicated – as moetune trains it
(`train.strategy ep`, engine/expert_parallel.py) for LoRA, and as Megatron-Core or
torchtitan would for full fine-tuning (moetune's ep trains LoRA only).

From the single-device analytic peak: the routed expert stacks (as stored) are 1/EP per
device – ⌈E/EP⌉ experts each; attention, routers, shared experts, embeddings and their
adapters are replicated. moetune holds each expert's LoRA factors on its owner only
(engine/ep_lora.py), so their weights, gradients and optimizer state are 1/EP per device as
well, and DDP's gradient buckets hold the replicated LoRA only; full fine-tuning
(other engines) shards the experts' own trainable state 1/EP too. Every device runs its own
micro-batch and receives its experts' share of every device's tokens. Token skew, stated:
the figures assume balanced routing (a device receives as many token copies as it sends),
so its expert activations are those of one device, plus the all-to-all dispatch and combine
receive buffers of one layer (top-k copies of each token's hidden state, in and out); at
worst – every device's tokens routed to one device's experts – that device's buffers and
expert activations grow EP-fold (the note gives the buffers' worst case).

With `train.ep_degree` the experts are split within groups of ep_degree ranks (EP =
ep_degree) and the rest – frozen weights and all the LoRA state – is FSDP2-sharded over
every rank (train/distributed/ep_mesh.py). The figure itself is the `ep` strategy's per-rank
plan (`plan.devices.sharding.plan_expert_parallel`), so the two always agree; this module
holds the bytes both read; the checks `--strategy ep` makes are config/ep_split.py's, the
launcher's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moetune.config import RunConfig
from moetune.errors import MoetuneError
from moetune.model.spec import ModelSpec
from moetune.plan.layout import adapter_layout
from moetune.plan.offload.memory import layer_expert_bytes
from moetune.plan.step import ADAPTER_BYTES, DTYPE_BYTES

EP_SKEW = (
    "ep assumes balanced routing: a rank receives as many token copies as it sends; with "
    "every rank's tokens routed to one rank's experts, that rank's all-to-all buffers and "
    "expert activations grow N-fold"
)
# the skew each train.ep_placement assumes, stated in the plan (EP_SKEW: contiguous groups)
PLACEMENT_SKEW = {
    "contiguous": EP_SKEW + " (contiguous groups: experts busy side by side skew it; "
    "train.ep_placement balanced evens it out)",
    "balanced": "ep places the experts by the base's measured routing (bin-packed, E/N a "
    "rank), so on the rows measured a rank receives at most the mean plus one expert's "
    "load; the plan assumes that balance – training can drift from the base's routing "
    "(routing.jsonl), and at worst every rank's tokens reach one rank's experts, whose "
    "all-to-all buffers and expert activations grow N-fold",
}


def ep_skew(cfg: RunConfig) -> str:
    """The token skew the plan assumes for the run's train.ep_placement."""
    return PLACEMENT_SKEW[cfg.train.ep_placement]


# Engines that train MoEs with expert parallelism in full fine-tuning (moetune: LoRA only).
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
    engines: tuple[str, ...] = ()  # other engines, where moetune does not train it (full)
    worst_all_to_all: int = 0  # the all-to-all buffers at the worst skew (all tokens here)
    placement: str = "contiguous"  # train.ep_placement: the skew stated (PLACEMENT_SKEW)
    sharded_over: int | None = None  # train.ep_degree: the ranks FSDP2 shards the rest over

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
            "trained_by_moetune": not self.engines,
            "skew_assumed": "balanced",
            "placement": self.placement,
            "skew_statement": PLACEMENT_SKEW[self.placement],
            "worst_skew_all_to_all_bytes": self.worst_all_to_all,
            "rest_sharded_over": self.sharded_over,
        }

    def describe(self) -> str:
        rest = "the rest replicated"
        if self.sharded_over:  # train.ep_degree: groups of EP ranks, the rest FSDP2
            rest = f"in groups of {self.ep} ranks, the rest FSDP2-sharded over {self.sharded_over}"
        held = (
            f"expert parallelism (EP = {self.ep}, {self.experts_per_device} experts per "
            f"device, {rest}) holds {self.peak_bytes / 1024**3:.1f} GiB of live "
            f"tensors per device at balanced routing (at worst skew the all-to-all buffers "
            f"reach {self.worst_all_to_all / 1024**3:.2f} GiB)"
        )
        if self.engines:
            others = "; ".join(self.engines)
            return f"{held}; moetune trains ep with LoRA only, full fine-tuning: {others}"
        mine = "each expert's LoRA state on its own device only"
        if self.sharded_over:  # FSDP2 shards all the LoRA state over every rank
            mine = f"all the LoRA state 1/{self.sharded_over} (FSDP2)"
        return f"{held}, {mine}; moetune trains it: train.strategy ep (--strategy ep)"


def split_trainable(single: dict[str, int], share: float, ep: int) -> dict[str, int]:
    """Trainable weights, gradients and optimizer state per device: the experts' `share`
    of each 1/EP (each device holds its own experts' only), the rest whole."""
    return {n: single[n] - round(single[n] * share * (ep - 1) / ep) for n in TRAINABLE
            if n in single}  # fmt: skip


def ddp_bucket_bytes(trainable_params: int, share: float, grad_bytes: int = ADAPTER_BYTES) -> int:
    """DDP's gradient buckets: the replicated trainable parameters' (not the experts')."""
    return round(trainable_params * (1 - share)) * grad_bytes


def expert_weight_bytes(spec: ModelSpec, cfg: RunConfig) -> int:
    """Frozen routed stacks as stored (none under full fine-tuning: they are trainable)."""
    if cfg.train.tuning == "full":
        return 0
    try:
        return layer_expert_bytes(spec, cfg) * len(spec.moe_layers)
    except MoetuneError:
        return 0


def held_expert_share(spec: ModelSpec, cfg: RunConfig, trainable: int) -> float:
    """The fraction of trainable parameters that live with the experts, which each rank
    holds 1/EP (engine/ep_lora.py slices their LoRA under either train.ep_placement – a
    balanced one moves the slices with their experts – and full fine-tuning their weights)."""
    if not trainable:
        return 0.0
    if cfg.train.tuning == "full":
        return spec.components.routed_experts / trainable
    layout = adapter_layout(spec, cfg.lora)
    expert = sum(a.lora_numel for layer in layout.layers for a in layer if a.kind == "experts")
    return expert / trainable


def all_to_all_bytes(spec: ModelSpec, cfg: RunConfig) -> int:
    """One layer's dispatch and combine receive buffers: top-k hidden states per token."""
    tokens = cfg.train.seq_len * cfg.train.batch_size
    return 2 * tokens * spec.top_k * spec.hidden_size * DTYPE_BYTES[cfg.model.dtype]
