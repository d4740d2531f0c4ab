"""One decoder layer's bytes in the training step: what it keeps for backward (its token
mixer's term, norms, adapted Linears' inputs, the experts), its W+ΔW copies, its checkpoint
and the transients of its backward. `plan.analytic` sums the layers into phases."""

from __future__ import annotations

from dataclasses import dataclass

from moetune.model.spec import ModelSpec
from moetune.plan.layout import Adapter
from moetune.plan.profiles.registry import ActivationProfile, MixerTerm, profile_for
from moetune.plan.step import ADAPTER_BYTES, Step


@dataclass(frozen=True)
class LayerCost:
    """One decoder layer's bytes in the step (see the module docstring)."""

    saved: int  # activations kept for backward (gradient checkpointing off)
    copies: int  # ParamWrapper W+ΔW copies kept for backward
    checkpoint: int  # the layer input kept with gradient checkpointing on
    backward_act: int  # activation gradients made in this layer's backward
    backward_copy: int  # full-size weight gradient of the first wrapped stack in backward
    grads: int  # this layer's trainable gradients


def layer_cost(
    spec: ModelSpec,
    step: Step,
    adapters: tuple[Adapter, ...] | None,
    i: int,
    mixer: MixerTerm,
    grad_free: bool = False,
) -> LayerCost:
    """Layer `i`'s bytes with its token mixer's term (an uncalibrated kind: none); a
    `grad_free` mixer (`_grad_free`) keeps nothing."""
    prof = profile_for(spec.model_type)
    full = adapters is None
    wrapped = () if full else tuple(a for a in adapters if a.via == "param")  # type: ignore[union-attr]
    experts_trained = full or any(a.kind == "experts" for a in wrapped)
    mixing = 0 if grad_free else _mixer_bytes(spec, prof, mixer, adapters, i)
    mlp = _mlp_bytes(spec, prof, adapters, i, experts_trained)
    per_token = mixing + mlp
    if i == 0 and not (full or step.gradient_checkpointing):
        per_token -= prof.frozen_input(spec)
    saved = per_token * step.tokens + mixer.pairs(spec) * step.pairs
    saved = saved * step.act_bytes // 2
    copies = sum(a.base_numel + _factor_cast(a) for a in wrapped) * _copy_bytes(step)
    act_grad, copy_grad = _backward_extra(spec, step, wrapped, (i, mixer, mlp), experts_trained)
    if step.split_lora:  # split LoRA never forms a stack's W+ΔW nor its full-size weight
        # gradient; its grouped matmuls keep activation-dtype copies of the factors instead
        copies -= sum(a.base_numel for a in wrapped if _is_stack(a)) * _copy_bytes(step)
        copy_grad = copy_grad if i not in spec.moe_layers else 0
    return LayerCost(
        saved=saved,
        copies=copies,
        checkpoint=2 * residual_width(spec, prof) * step.tokens * step.act_bytes // 2,
        backward_act=act_grad,
        backward_copy=copy_grad,
        grads=_layer_grads(spec, step, adapters, i),
    )


def residual_width(spec: ModelSpec, prof: ActivationProfile) -> int:
    """The residual's width: hidden, times the streams of hyper-connections."""
    return prof.streams(spec) * spec.hidden_size


def is_attention(spec: ModelSpec, i: int) -> int:
    return int(i in spec.attention_layers)


def _copy_bytes(step: Step) -> int:
    """W+ΔW is made in the stack's dtype: bf16, or fp32 after QLoRA's upcast."""
    return 4 if step.method == "qlora" else step.weight_bytes


def _is_stack(a: Adapter) -> bool:
    """A 3-D expert stack (what split LoRA takes over); a 2-D ParamWrapper – a shared
    expert's or the dense MLP's weight targeted as a parameter – stays peft's, and keeps its
    W+ΔW for backward under split LoRA too (DeepSeek-V2-Lite: ≈ 1 GiB at any seq)."""
    return a.base_numel > a.in_features * a.out_features


def _factor_cast(a: Adapter) -> int:
    """3-D stacks fold B@A in with one baddbmm on bf16 copies of the factors (kept)."""
    return a.lora_numel if _is_stack(a) else 0


def _mixer_bytes(
    spec: ModelSpec,
    prof: ActivationProfile,
    mixer: MixerTerm,
    adapters: tuple[Adapter, ...] | None,
    i: int,
) -> int:
    """Norms, the token mixer's core, and every lora.Linear's kept inputs, per token."""
    h = spec.hidden_size
    total = prof.norms * 4 * h + prof.residual(spec) + mixer.per_token(spec)
    if adapters is None:  # full: every weight needs its input and each norm its output
        if not is_attention(spec, i):
            return total
        q = spec.num_attention_heads * spec.head_dim
        return total + 2 * h + 2 * q + prof.norms * 2 * h
    # lora.Linear casts its input to fp32 for lora_A and keeps lora_A's output
    kept = [a for a in adapters if a.via == "linear" and not a.name.startswith(mixer.no_grad)]
    return total + sum(4 * a.in_features + 4 * a.rank for a in kept)


def _mlp_bytes(
    spec: ModelSpec,
    prof: ActivationProfile,
    adapters: tuple[Adapter, ...] | None,
    i: int,
    experts_trained: bool,
) -> int:
    """Routed experts + router, shared experts, or the dense MLP, per token."""
    h = spec.hidden_size
    if i not in spec.moe_layers:
        dense = _weights_trained(adapters, "dense")
        return _glu_bytes(h, spec.dense_intermediate_size, dense, prof.glu_saved)
    k, inter = spec.top_k, spec.expert_intermediate_size
    routed = (
        (4 * k * h + prof.gate_saved * k * inter)
        if experts_trained
        else (2 * k * h + (prof.gate_saved - 2) * k * inter)
    )
    if prof.routed is not None:  # a family's own expert loop (longcat's identity experts)
        routed = prof.routed(spec, experts_trained)
    router = 4 * spec.num_experts + 16 * k
    trained = _weights_trained(adapters, "shared")
    shared = _glu_bytes(h, spec.shared_intermediate_size, trained, prof.glu_saved)
    if prof.shared_gate and spec.shared_intermediate_size:
        shared += 2 * h
    beside = _glu_bytes(h, prof.mlp_beside_experts(spec), _weights_trained(adapters, "dense"))
    return routed + router + shared + beside + prof.moe_layer_extra(spec)


def _weights_trained(adapters: tuple[Adapter, ...] | None, kind: str) -> bool:
    """Full training, or a ParamWrapper on this kind's Linear weights (their input is kept)."""
    return adapters is None or any(a.kind == kind and a.via == "param" for a in adapters)


def _glu_bytes(hidden: int, inter: int, weights_trained: bool, saved: int = 6) -> int:
    """Gated MLP: gate out, activation, up out (`saved`·I: more where it clamps); + inputs
    when the weights need gradients."""
    if not inter:
        return 0
    return saved * inter + (2 * hidden + 2 * inter if weights_trained else 0)


def _backward_extra(
    spec: ModelSpec,
    step: Step,
    wrapped: tuple[Adapter, ...],
    layer: tuple[int, MixerTerm, int],
    experts_trained: bool,
) -> tuple[int, int]:
    """(activation-gradient bytes, weight-gradient bytes) on top of the layer's saved set.

    The largest of: a late mixer backward's transients (net of the MLP's freed saved set);
    the routed tokens' gradients (4·k·H + 4·k·I per token); with LoRA on
    the stacks, the down stack's full-size weight gradient next to its input gradient
    (2·k·I per token); for T² attention kernels, the extra probability-sized tensors
    (net of the MLP's saved set, freed before the mixer's backward).
    """
    (i, mixer, mlp), t, act = layer, step.tokens, step.act_bytes // 2
    # a T² kernel's backward runs after the MLP's: the MLP's saved set is freed by then
    attention = mixer.pair_transient * mixer.pairs(spec) * step.pairs - mlp * t * act
    candidates = [(max(0, int(attention)), 0), (mixer.forward_pairs(spec) * step.pairs, 0)]
    freed = profile_for(spec.model_type).mlp_residual(spec)  # the MLP side's stream mixing
    candidates.append(((mixer.backward(spec) - freed) * t * act, 0))
    # the mixer's own backward runs after the MLP's: the MLP's saved set is freed by then
    candidates.append(((mixer.late_backward(spec) - mlp) * t * act, 0))
    if i not in spec.moe_layers:
        inter = spec.dense_intermediate_size
        candidates.append((4 * inter * t * act, _largest(wrapped) * _copy_bytes(step)))
    else:
        k, h, inter = spec.top_k, spec.hidden_size, spec.expert_intermediate_size
        candidates.append(((4 * k * h + 4 * k * inter) * t * act, 0))
        if wrapped and experts_trained:
            down = _down_stack(wrapped, spec) * _copy_bytes(step)
            candidates.append((2 * k * inter * t * act, down))
    return max(candidates, key=sum)


def _down_stack(wrapped: tuple[Adapter, ...], spec: ModelSpec) -> int:
    loop = profile_for(spec.model_type).stack_grads  # an eager loop's full-size gradients
    if loop:
        return loop * _largest(wrapped)
    downs = [a.base_numel for a in wrapped if a.kind == "experts" and "down" in a.name]
    return max(downs) if downs else _largest(wrapped)


def _largest(wrapped: tuple[Adapter, ...]) -> int:
    return max((a.base_numel for a in wrapped), default=0)


def _layer_grads(spec: ModelSpec, step: Step, adapters: tuple[Adapter, ...] | None, i: int) -> int:
    if adapters is not None:
        return sum(a.lora_numel for a in adapters) * ADAPTER_BYTES
    return _layer_params(spec, i) * step.weight_bytes


def _layer_params(spec: ModelSpec, i: int) -> int:
    """Parameters of decoder layer `i` (for full fine-tuning), from the component counts."""
    c = spec.components
    attention = (c.attention + c.norms) // max(1, len(spec.attention_layers))
    n_moe, n_dense = len(spec.moe_layers), len(spec.dense_layers)
    if i in spec.moe_layers:
        return attention + (c.routed_experts + c.shared_experts + c.routers) // max(1, n_moe)
    return attention + c.dense_mlp // max(1, n_dense)
