"""The byte sizes every per-device strategy needs, from one analytic estimate of the run
(`run_sizes`): the single-device peak by component, one decoder layer's weights and
gradients, the largest module DeepSpeed fetches, the root FSDP2 keeps gathered, and what
expert parallelism places (the routed stacks as held, the all-to-all buffers, the experts'
trainable share). `plan.devices.sharding` splits them per strategy."""

from __future__ import annotations

from dataclasses import dataclass

from moetune.config import RunConfig
from moetune.config.keys import offload_mode
from moetune.model.spec import ModelSpec
from moetune.plan.analytic import AnalyticEstimate, expert_bytes_per_param
from moetune.plan.devices.expert_parallel import (
    all_to_all_bytes,
    expert_weight_bytes,
    held_expert_share,
)
from moetune.plan.fit import analytic
from moetune.plan.layout import adapter_layout
from moetune.plan.step import ADAPTER_BYTES, Step


@dataclass(frozen=True)
class Sizes:
    """What the strategies need, in bytes, from one analytic estimate of the run."""

    single: dict[str, int]  # the single-device peak by component
    trainable_params: int
    grad_bytes: int  # per trainable parameter
    weight_bytes: int  # the frozen weights' dtype
    largest_layer: int  # one decoder layer's weights as held (frozen + trainable)
    largest_layer_grads: int  # one decoder layer's trainable gradients, full size
    largest_module: int  # parameters (elements) of the largest module (a layer's experts)
    root: int  # embeddings, final norm, LM head (and other non-layer weights)
    persistent: int  # weights below DeepSpeed's persistence threshold (norms)
    # zero3 builds this base under zero.Init (a float checkpoint read by from_pretrained,
    # experts in bf16, nothing offloaded); else every rank builds it whole first
    zero3_partitioned: bool = False
    expert_weights: int = 0  # the frozen routed expert stacks as held (ep places them 1/N)
    all_to_all: int = 0  # ep: one layer's dispatch + combine receive buffers, balanced routing
    ep_degree: int | None = None  # train.ep_degree: ranks a group split the experts over
    expert_share: float = 0.0  # the trainable parameters' share on the routed experts (ep: 1/N)
    stored: bool = False  # a base kept as stored: on several processes only ep trains it


def run_sizes(spec: ModelSpec, cfg: RunConfig, est: AnalyticEstimate | None = None) -> Sizes:
    """The byte sizes every strategy needs (one analytic estimate; layouts are cached)."""
    est = est or analytic(spec, cfg)
    step = Step.from_config(cfg, spec)
    full = step.method == "full"
    lora = [0] * spec.num_layers if full else _lora_per_layer(spec, cfg)
    grad = step.weight_bytes if full else ADAPTER_BYTES
    layers = [_layer_bytes(spec, step, i) + lora[i] * ADAPTER_BYTES for i in range(spec.num_layers)]
    grads = [
        (_layer_numel(spec, i) * grad if full else lora[i] * grad) for i in range(spec.num_layers)
    ]
    c = spec.components
    return Sizes(
        single=dict(est.components),
        trainable_params=est.trainable_params,
        grad_bytes=grad,
        weight_bytes=step.weight_bytes,
        largest_layer=max(layers, default=0),
        largest_layer_grads=max(grads, default=0),
        largest_module=max(_largest_modules(spec)),
        root=(c.embeddings + c.lm_head + c.other + _outside_norms(spec)) * step.weight_bytes,
        persistent=c.norms * step.weight_bytes,
        zero3_partitioned=zero3_partitioned(spec, cfg),
        expert_weights=expert_weight_bytes(spec, cfg),
        all_to_all=all_to_all_bytes(spec, cfg),
        ep_degree=cfg.train.ep_degree,
        expert_share=held_expert_share(spec, cfg, est.trainable_params),
        stored=bool(step.stored_bytes),
    )


def zero3_partitioned(spec: ModelSpec, cfg: RunConfig) -> bool:
    """Whether a zero3 run's ranks build the base partitioned, under zero.Init (the plan's
    host RAM and train/distributed/zero3_load.py alike): the loads through from_pretrained;
    int8 / NF4
    stacks, a published quantised or GGUF base and offloaded stacks are built by moetune's
    own loaders, whole on every rank."""
    m = cfg.model
    from_pretrained = not (m.is_gguf or spec.quant_config)
    streams = offload_mode(cfg.train.offload).streams
    return m.experts_dtype == "bf16" and not streams and from_pretrained


def _lora_per_layer(spec: ModelSpec, cfg: RunConfig) -> list[int]:
    layout = adapter_layout(spec, cfg.lora)
    return [sum(a.lora_numel for a in layer) for layer in layout.layers]


def _per(total: int, n: int) -> int:
    return total // max(1, n)


def _layer_parts(spec: ModelSpec, i: int) -> tuple[int, int, int]:
    """(mixer + norms, routed experts, other MLP weights) of layer `i`, in elements."""
    c = spec.components
    mixer = _per(c.attention + c.norms - _outside_norms(spec), spec.num_layers)
    if i in spec.moe_layers:
        n = len(spec.moe_layers)
        return mixer, _per(c.routed_experts, n), _per(c.shared_experts + c.routers, n)
    return mixer, 0, _per(c.dense_mlp, len(spec.dense_layers))


def _outside_norms(spec: ModelSpec) -> int:
    return spec.hidden_size  # the final norm (a model's only norm outside its layers)


def _layer_numel(spec: ModelSpec, i: int) -> int:
    return sum(_layer_parts(spec, i))


def _layer_bytes(spec: ModelSpec, step: Step, i: int) -> int:
    mixer, routed, rest = _layer_parts(spec, i)
    experts = routed * expert_bytes_per_param(spec, step)
    return int((mixer + rest) * step.weight_bytes + experts)


def _largest_modules(spec: ModelSpec) -> list[int]:
    """Candidates for DeepSpeed's largest fetched module: a layer's expert stacks, its
    mixer, a dense MLP, the embeddings, the LM head."""
    c = spec.components
    experts = _per(c.routed_experts, len(spec.moe_layers))
    mixer = _per(c.attention, len(spec.attention_layers))
    return [experts, mixer, _per(c.dense_mlp, len(spec.dense_layers)), c.embeddings, c.lm_head]
