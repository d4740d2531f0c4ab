"""What train.method changes in the memory plan, by a registry keyed by method.

    sft    the step as configured: batch_size sequences of seq_len tokens.
    dpo    TRL concatenates chosen and rejected: the trained step holds 2 × batch_size
           sequences. The reference pass is the same weights with the adapter disabled
           under no_grad (its activations are freed before the policy pass): 0 bytes more.
    grpo   the trained step holds batch_size sequences of prompt (train.seq_len, the prompt
           budget) + completion (grpo.max_completion_length) tokens. Before it, the rollout:
           generate keeps a KV cache for the rollout batch (batch_size × grad_accum
           sequences, TRL's generation_batch_size: every prompt's num_generations samples
           are rows of it) × (prompt + completion) tokens, and one step of last-position
           logits; its peak is the frozen and trainable state plus both, and the plan's
           peak is the larger of the two phases. The routing-shift recorder keeps, in host
           RAM, the last ROLLOUTS_KEPT rollouts' tokens and, per MoE layer, their top-k
           expert indices (int64); with train.grpo.routing_replay: replay the training pass
           also holds, on the device, the replayed [tokens, k] indices of every MoE layer
           (gradient checkpointing re-runs the routers with them): a term of its own.

Each term is a pure function of the config and the spec, used by the analytic estimate and
the trace alike (the trace traces the trained step's shape; the rollout is added here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moetune.plan.step import DTYPE_BYTES

if TYPE_CHECKING:
    from moetune.config import RunConfig
    from moetune.model.spec import ModelSpec

ROLLOUT_LOGIT_BYTES = 4  # fp32 logits of the position being sampled
INDEX_BYTES = 8  # a routed expert index (int64, as torch.topk returns it)
ROLLOUTS_KEPT = 8  # generate calls the routing-shift recorder keeps to match training rows


@dataclass(frozen=True)
class MethodTerms:
    """The trained step's shape and the rollout's bytes (0 for methods without one)."""

    seq_len: int
    batch_size: int
    kv_cache_bytes: int = 0
    rollout_logits_bytes: int = 0
    routing_record_bytes: int = 0  # host RAM: kept rollouts' tokens + top-k per MoE layer
    replay_bytes: int = 0  # device: the replayed indices of the trained step (replay only)

    @property
    def rollout_bytes(self) -> int:
        return self.kv_cache_bytes + self.rollout_logits_bytes


def _sft(cfg: RunConfig, spec: ModelSpec) -> MethodTerms:
    return MethodTerms(cfg.train.seq_len, cfg.train.batch_size)


def _dpo(cfg: RunConfig, spec: ModelSpec) -> MethodTerms:
    return MethodTerms(cfg.train.seq_len, 2 * cfg.train.batch_size)


def kv_cache_bytes(spec: ModelSpec, sequences: int, tokens: int, weight_bytes: int) -> int:
    """K and V of every attention layer for `sequences` × `tokens` positions."""
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * weight_bytes
    return sequences * tokens * per_token


def routed_index_bytes(spec: ModelSpec, tokens: int) -> int:
    """The top-k expert indices of `tokens` tokens in every MoE layer."""
    return tokens * len(spec.moe_layers) * spec.top_k * INDEX_BYTES


def _grpo(cfg: RunConfig, spec: ModelSpec) -> MethodTerms:
    t, g = cfg.train, cfg.train.grpo
    tokens = t.seq_len + g.max_completion_length
    rollout = t.batch_size * t.grad_accum  # TRL: generation_batch_size per device
    kept = ROLLOUTS_KEPT * rollout * tokens  # tokens of the kept rollouts
    replay = g.routing_replay == "replay"
    return MethodTerms(
        seq_len=tokens,
        batch_size=t.batch_size,
        kv_cache_bytes=kv_cache_bytes(spec, rollout, tokens, DTYPE_BYTES[cfg.model.dtype]),
        rollout_logits_bytes=rollout * spec.vocab_size * ROLLOUT_LOGIT_BYTES,
        routing_record_bytes=kept * INDEX_BYTES + routed_index_bytes(spec, kept),
        replay_bytes=routed_index_bytes(spec, t.batch_size * tokens) if replay else 0,
    )


METHOD_TERMS: dict[str, Callable[[RunConfig, ModelSpec], MethodTerms]] = {
    "sft": _sft,
    "dpo": _dpo,
    "grpo": _grpo,
}


def method_terms(cfg: RunConfig, spec: ModelSpec) -> MethodTerms:
    return METHOD_TERMS[cfg.train.method](cfg, spec)


def as_trained(cfg: RunConfig, spec: ModelSpec) -> RunConfig:
    """`cfg` with train.seq_len / batch_size set to the step the method really trains."""
    terms = method_terms(cfg, spec)
    shape = {"seq_len": terms.seq_len, "batch_size": terms.batch_size}
    return cfg.model_copy(update={"train": cfg.train.model_copy(update=shape)})


STATIC = ("frozen_weights", "trainable_weights", "optimizer_state")  # live in every phase


def with_rollout(
    terms: MethodTerms, peak: int, components: dict[str, int], phase: str
) -> tuple[int, dict[str, int], str]:
    """(peak, components, phase) once the rollout is counted: the weights and optimizer
    state plus the KV cache and logits, when that is more than the trained step's peak
    (which holds the replayed routing indices where routing replay is on)."""
    if terms.replay_bytes:
        peak, components = peak + terms.replay_bytes, {**components}
        components["routing_replay"] = terms.replay_bytes
    if not terms.rollout_bytes:
        return peak, components, phase
    static = {k: components.get(k, 0) for k in STATIC}
    rollout = {
        **static,
        "kv_cache": terms.kv_cache_bytes,
        "rollout_logits": terms.rollout_logits_bytes,
    }
    if sum(rollout.values()) <= peak:
        return peak, components, phase
    return sum(rollout.values()), rollout, "rollout"


def method_notes(cfg: RunConfig, spec: ModelSpec) -> list[str]:
    """What the plan says about train.method's terms (nothing for sft)."""
    terms, t = method_terms(cfg, spec), cfg.train
    if t.method == "dpo":
        return [
            f"dpo: chosen + rejected = {terms.batch_size} sequences per micro-batch; the "
            "reference is the base with the adapter disabled (same weights, no copy)"
        ]
    if t.method == "grpo":
        return [
            f"grpo: trains {terms.batch_size} × {terms.seq_len} tokens (prompt budget "
            f"train.seq_len + max_completion_length); rollout KV cache "
            f"{terms.kv_cache_bytes / 2**30:.2f} GiB for {t.batch_size * t.grad_accum} "
            f"sequences (num_generations {t.grpo.num_generations} per prompt)",
            routing_note(terms, spec, t.grpo.routing_replay),
        ]
    return []


def routing_note(terms: MethodTerms, spec: ModelSpec, replay: str) -> str:
    """What recording (and replaying) the rollout's routing keeps."""
    k, layers = spec.top_k, len(spec.moe_layers)
    line = (
        f"grpo routing record: {k} expert indices per token × {layers} MoE layers for the "
        f"last {ROLLOUTS_KEPT} rollouts, {terms.routing_record_bytes / 2**20:.1f} MiB of host "
        "RAM"
    )
    if replay == "replay":
        return line + f"; routing replay holds {terms.replay_bytes / 2**20:.1f} MiB on the device"
    return line + "; routing_replay off"
