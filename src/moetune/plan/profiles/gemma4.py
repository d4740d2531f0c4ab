"""Gemma 4's attention terms, per token and by layer type (`plan.profiles` registers them).

Read off the saved tensors (`torch.autograd.graph.saved_tensors_hooks`, layer by layer) of
transformers 5.24's Gemma4TextAttention under SDPA, as the trace runs it:

- q, k and v each pass a per-head RMSNorm (v's without a scale) that computes in fp32: each
  keeps its fp32 input (4 B per element) and two fp32 values per head (mean square, its
  power −½: 8 B per head). With `attention_k_eq_v` (full-attention layers of the released
  checkpoints) v is k_proj's output, normed a second time: the same bytes.
- Sliding-window layers pass SDPA a mask, so transformers repeats k and v to every query
  head first: q, k, v and the output at full query width in bf16, the fp32 log-sum-exp per
  head, and the bf16 window mask per layer (2 B per query·key pair). A sequence no longer
  than the window gets no mask (is_causal): then the term is a little high.
- Full-attention layers get no mask (is_causal): GQA runs on the key/value heads unless
  the head dim is over 256 (transformers' `use_gqa_in_sdpa`), as Gemma-4-26B-A4B's 512 is,
  and k, v are repeated to every head. They take their head dim and key/value heads from
  the config's `per_layer_config` (`global_head_dim`, `num_global_key_value_heads`).

- Per-layer inputs (`hidden_size_per_layer_input`, the census' tiny config; the released
  MoE has none): each layer keeps its gate's output (the GELU input, bf16) and the fp32 input
  of the norm after its projection; the (tokens × layers × width) bf16 input tensor lives
  for the whole step, and with checkpointing (the embeddings then require grad) its RMSNorm's
  fp32 input too.

Beside the mixer the profile sizes eight full-width fp32 norm inputs per layer (input,
post-attention, pre/post feed-forward, the post norms of the dense and expert branches,
the experts' pre-norm, the router's) and the dense MLP that runs beside the experts. Layers
that reuse another layer's k/v (`num_kv_shared_layers`) are not sized (they stay traced).

At the released heads (query width 16 × 512 = 8192 on full layers) but tiny width, the
checkpointed step peaks in the full layer's backward, inside q's norm: five query-width fp32
tensors (the pow / mean / mul gradients) beside the k / v norms' fp32 gradients, after the
MLP's and SDPA's saved sets and o_proj's adapter input are freed (`q_norm_backward`, a
`MixerTerm.late_backward`). Read off the live tensors at the trace's peak and fitted at seq
2048 (16 and 8 heads, k = v) and at 8 kv heads × 512 without k = v (16 B per kv element
where v is k, 8 without); at real widths the experts' backward stays larger.

Checked against `trace_step` (seq 128, gc off − gc on, and both peaks) on the census shape
(4 × 16 heads, window 32, per-layer inputs 256), at seq 256, with per-layer inputs of 64 and
none, with the released full-layer layout (k = v, one kv head of twice the dim), and held
out at 8 heads with a 64-token window: kept within 1.3 %, peaks within 1.1 %, all low.
"""

from __future__ import annotations

from collections.abc import Callable

from moetune.model.spec import ModelSpec

GQA_MAX_HEAD_DIM = 256  # transformers' use_gqa_in_sdpa: larger head dims repeat k, v


def full_layer_dims(spec: ModelSpec) -> tuple[int, int]:
    """(head dim, key/value heads) of the full-attention layers: `per_layer_config`'s
    override of the first one (its keys are layer indices, zero-padded in released configs)."""
    c = spec.hf_config
    full = [i for i, t in enumerate(c.get("layer_types") or []) if t == "full_attention"]
    per_layer = {int(k): v for k, v in (c.get("per_layer_config") or {}).items()}
    over = per_layer.get(full[0], {}) if full else {}
    return over.get("head_dim", spec.head_dim), over.get("num_key_value_heads", spec.num_kv_heads)


def qkv_norms(spec: ModelSpec, head_dim: int, kv_heads: int) -> int:
    """Per-head fp32 RMSNorms on q, k and v: their fp32 inputs + two fp32 values per head."""
    heads = spec.num_attention_heads
    return 4 * head_dim * (heads + 2 * kv_heads) + 8 * (heads + 2 * kv_heads)


def sdpa_bytes(spec: ModelSpec, head_dim: int, kv_heads: int, repeated: bool) -> int:
    """SDPA's q, k, v, out in bf16 (k, v at the query heads when repeated) + fp32 lse."""
    heads = spec.num_attention_heads
    kv = heads if repeated else kv_heads
    return 2 * head_dim * (2 * heads + 2 * kv) + 4 * heads


def gemma4_sliding(spec: ModelSpec) -> int:
    """A sliding-window layer: masked SDPA (k, v repeated to every head) after the norms."""
    d, kv = spec.head_dim, spec.num_kv_heads
    return qkv_norms(spec, d, kv) + sdpa_bytes(spec, d, kv, repeated=True) + per_layer_input(spec)


def gemma4_full(spec: ModelSpec) -> int:
    """A full-attention layer: causal SDPA on its own head dim / key-value heads."""
    d, kv = full_layer_dims(spec)
    attention = sdpa_bytes(spec, d, kv, repeated=d > GQA_MAX_HEAD_DIM)
    return qkv_norms(spec, d, kv) + attention + per_layer_input(spec)


def per_layer_input(spec: ModelSpec) -> int:
    """Per-layer inputs (`hidden_size_per_layer_input`): each layer's gate output (the GELU
    input, bf16) and the fp32 input of the norm after its projection."""
    width = spec.hf_config.get("hidden_size_per_layer_input") or 0
    return 2 * width + 4 * spec.hidden_size + 8 if width else 0


Q_NORM_BACKWARD = 20  # fp32 bytes per query element while q's norm runs backward (5 tensors)
O_PROJ_INPUT = 4  # o_proj's adapter keeps its (query-width) input in fp32: freed by then
KV_BACKWARD = 8  # fp32 bytes per key/value element alive then (k / v norm gradients; fitted)
FREED_NORMS = 7  # of the layer's 8 full-width norms, those after the mixer (freed by then)


def q_norm_backward(full: bool) -> Callable[[ModelSpec], int]:
    """The q norm's fp32 backward (the pow / mean / mul gradients: five query-width fp32
    tensors) and the k / v norms' fp32 gradients (twice where v is k), net of what is freed
    by then: SDPA's saved set, o_proj's adapter input and the norms after the mixer. Only a
    layer whose query width dwarfs its hidden size peaks here (tiny widths at the released
    heads); at real widths the experts' backward is larger."""

    def late(spec: ModelSpec) -> int:
        d, kv = full_layer_dims(spec) if full else (spec.head_dim, spec.num_kv_heads)
        repeated = d > GQA_MAX_HEAD_DIM if full else True
        query = spec.num_attention_heads * d
        freed = sdpa_bytes(spec, d, kv, repeated) + FREED_NORMS * 4 * spec.hidden_size
        k_eq_v = full and bool(spec.hf_config.get("attention_k_eq_v"))
        kv_bytes = KV_BACKWARD * (1 + k_eq_v) * kv * d  # k = v: both norms' gradients on k
        return (Q_NORM_BACKWARD - O_PROJ_INPUT) * query + kv_bytes - freed

    return late


def _per_layer_width(spec: ModelSpec) -> int:
    return int(spec.hf_config.get("hidden_size_per_layer_input") or 0)


def per_layer_inputs(spec: ModelSpec) -> int:
    """Every layer's per-layer input, per token, for the whole step: the bf16 tensor the
    layers read (each layer's product keeps its slice)."""
    return 2 * _per_layer_width(spec) * spec.num_layers


def per_layer_inputs_norm(spec: ModelSpec) -> int:
    """With checkpointing the embeddings require grad, so the per-layer inputs' RMSNorm keeps
    its fp32 input and two fp32 values per layer, per token, for the whole step."""
    width = _per_layer_width(spec)
    return (4 * width + 8) * spec.num_layers if width else 0


def gemma4_dense_mlp(spec: ModelSpec) -> int:
    """The intermediate size of the dense MLP beside the experts."""
    return int(spec.hf_config.get("intermediate_size") or 0)
