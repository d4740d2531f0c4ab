"""Saved-bytes terms of the token mixers whose kernel is the same across families: SDPA
(fused, masked, with q/k norms or an output gate), eager attention, LFM2's short
convolution, Kimi delta attention and lightning attention. How each was read off the
trace is documented in `plan.profiles`, which composes them into family profiles."""

from __future__ import annotations

from collections.abc import Callable

from moetune.model.spec import ModelSpec

SpecInt = Callable[[ModelSpec], int]


def _dims(spec: ModelSpec) -> tuple[int, int, int]:
    """(query width, key/value width, heads) of grouped-query attention."""
    heads = spec.num_attention_heads
    return heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, heads


def sdpa_fused(spec: ModelSpec) -> int:
    """Flash / memory-efficient SDPA: q, k, v, out in bf16 + fp32 logsumexp per head."""
    q, kv, heads = _dims(spec)
    return 2 * (2 * q + 2 * kv) + 4 * heads


def sdpa_fused_qk_norm(spec: ModelSpec) -> int:
    """Fused SDPA after q/k RMSNorm (Qwen3 per head, OLMoE full width): + fp32 q and k."""
    q, kv, _ = _dims(spec)
    return sdpa_fused(spec) + 4 * (q + kv)


def eager_repeat_kv(spec: ModelSpec) -> int:
    """Eager attention: q and k, v repeated to every head, in bf16."""
    q, _, _ = _dims(spec)
    return 2 * 3 * q


def sdpa_gated_qk_norm(spec: ModelSpec) -> int:
    """Per-head q/k norms (+ their fp32 rstd) and a sigmoid gate on the output (Qwen3-Next)."""
    q, _, heads = _dims(spec)
    return sdpa_fused_qk_norm(spec) + 4 * q + 4 * (heads + spec.num_kv_heads)


def short_conv(spec: ModelSpec) -> int:
    """LFM2's gated short convolution, per token: 16·H (see the module docstring)."""
    return 16 * spec.hidden_size


KDA_CHUNK = 64  # chunk_kimi_delta_attention's chunk size
KDA_BACKWARD = 2.25  # decay-mask-sized fp32 gradients alive at once in its backward (fitted)


def _kda(spec: ModelSpec) -> tuple[int, int, int]:
    """(heads, head dim, chunk) of Kimi delta attention: q, k and v share the head dim."""
    c = spec.hf_config
    return c["linear_num_heads"], c["linear_head_dim"], KDA_CHUNK


def kimi_delta_attention(spec: ModelSpec) -> int:
    """KDA through transformers' torch chunked kernel, per token (see the module docstring)."""
    heads, dk, chunk = _kda(spec)
    triangle = 4 * (chunk - 1) * (2 * chunk - 1) // 6  # the row loop's clones, Σ i² / C
    per_head = 12 * chunk * dk + triangle + 111 * dk + 6 * dk * dk // chunk + 277
    return heads * per_head


def kda_backward(spec: ModelSpec) -> int:
    """KDA's backward: gradients of its per-channel C×C×dk decay tensors (fp32)."""
    heads, dk, chunk = _kda(spec)
    return int(KDA_BACKWARD * 4 * heads * chunk * dk)


LIGHTNING = (24, 2)  # bytes per head dim, per block position (fitted; see below)


def lightning_attention(spec: ModelSpec) -> int:
    """MiniMax's lightning attention (its torch block loop, bf16), per token: per head the
    projections' activations and copies (~24·d), each block's masked q·k (2·B) and the
    d×d state per block (2·d²/B) – fitted to the trace (see the module docstring)."""
    d, block = spec.head_dim, spec.hf_config["block_size"]
    return spec.num_attention_heads * (LIGHTNING[0] * d + LIGHTNING[1] * block + 2 * d * d // block)


def sdpa_masked(spec: ModelSpec) -> int:
    """SDPA given a mask (a sliding window): k and v are repeated to every head first."""
    q, _, heads = _dims(spec)
    return 2 * 4 * q + 4 * heads


def sdpa_masked_qk_norm(spec: ModelSpec) -> int:
    """Masked SDPA after per-head q/k RMSNorms: + fp32 q and k (as `sdpa_fused_qk_norm`)."""
    q, kv, _ = _dims(spec)
    return sdpa_masked(spec) + 4 * (q + kv)


def heads_pairs(bytes_per_head: int) -> SpecInt:
    """Bytes per query·key pair for kernels that materialise the probabilities."""
    return lambda spec: bytes_per_head * spec.num_attention_heads


def layer_type_masks(spec: ModelSpec) -> int:
    """One additive bf16 mask per distinct layer type (eager attention)."""
    return max(1, len(set(spec.hf_config.get("layer_types") or ["full"])))
