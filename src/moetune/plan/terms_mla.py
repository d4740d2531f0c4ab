"""Saved-bytes terms of the MLA variants beyond DeepSeek's (hy_v4, longcat_flash).

Read, like `plan.profiles`' terms, off the fake-tensor trace's saved tensors
(`torch.autograd.graph.saved_tensors_hooks`, per module) and checked against `trace_step`:

- hy_v4 (and its VL text model) attention: MLA with a DSA indexer, but eager only (the class
  supports neither SDPA nor flash) and with a learnt sink per head. Its logits meet the fp32
  sinks, so the softmax runs in fp32 over s + 1 columns: autograd keeps the fp32
  probabilities (4·heads per pair, + the sink column per token), the row max's int64 index
  (8·heads per token), their bf16 cast for the value matmul (2·heads per pair), q and the
  per-head k (bf16), v – a view that keeps kv_b_proj's whole output – and the output gate's
  input and sigmoid (bf16, heads × v dim each). The indexer runs under no_grad (its scores
  are the DSA term's); the top-k mask is only added to the logits, so no layer keeps it.
  Its experts clamp gate and up before the SwiGLU: 12·k·I per token beside the experts'
  gathered input and output (gate/up output 4·I, the two clamps, silu and product 2·I each).
- Hyper-connections (hy_v4): the residual is `hc_mult` streams of the hidden size, so a
  layer's input (what checkpointing keeps) is streams × hidden. Each of the layer's two
  connections flattens the streams to fp32 (4·N·H, its unweighted RMSNorm's rstd 4 B), keeps
  the bf16 streams for the pre-weighted sum (2·N·H), the fp32 mixes, both sigmoids and the
  pre weights (20·N), and its write-back keeps the sublayer's output in fp32 (4·H) and the
  post weights (4·N): 6·N·H + 4·H + 24·N + 4 per connection. The head that collapses the
  streams before the final norm keeps 6·N·H + 12·N + 4 once. Without checkpointing the first
  layer's input (the frozen embeddings, expanded) needs no gradient under LoRA: its attention
  connection and input norm keep nothing, its write-back only the post weights.

Fitted at hidden 64, four heads, N = 4 (the census' tiny config) at seq 128 and checked on
held-out shapes (see tests/test_plan_mixers.py's CALIBRATED list).
"""

from __future__ import annotations

from moetune.model.spec import ModelSpec


def _c(spec: ModelSpec, name: str) -> int:
    return int(spec.hf_config.get(name) or 0)


def sink_mla_attention(spec: ModelSpec) -> int:
    """hy_v4's eager MLA with sinks and an output gate, per token (pairs: `sink_mla_pairs`)."""
    heads = spec.num_attention_heads
    qk = heads * (_c(spec, "qk_nope_head_dim") + _c(spec, "qk_rope_head_dim"))
    v = heads * _c(spec, "v_head_dim")
    kv_b = heads * _c(spec, "qk_nope_head_dim") + v
    norms = 4 * (_c(spec, "kv_lora_rank") + _c(spec, "q_lora_rank")) + 8  # + fp32 rstd each
    # q, k; v's view of kv_b's output; row max index + sink column; gate in and sigmoid
    return norms + 2 * 2 * qk + 2 * kv_b + (8 + 4) * heads + 2 * 2 * v


def sink_mla_pairs(spec: ModelSpec) -> int:
    """The fp32 probabilities and their bf16 cast, per query·key pair."""
    return 6 * spec.num_attention_heads


def hyper_streams(spec: ModelSpec) -> int:
    """Residual streams a layer passes on (1 without hyper-connections)."""
    return _c(spec, "hc_mult") or 1


def hyper_layer(spec: ModelSpec) -> int:
    """A layer's two hyper-connections (attention's and the MLP's), per token."""
    n, h = hyper_streams(spec), spec.hidden_size
    return 2 * (6 * n * h + 4 * h + 24 * n + 4)


def hyper_head(spec: ModelSpec) -> int:
    """The streams' collapse before the final norm, per token."""
    n, h = hyper_streams(spec), spec.hidden_size
    return 6 * n * h + 12 * n + 4


def hyper_frozen_input(spec: ModelSpec) -> int:
    """What the first layer's attention connection, its write-back's fp32 sublayer output and
    the input norm (4·H + 4) do not keep when the layer's input needs no gradient."""
    n, h = hyper_streams(spec), spec.hidden_size
    return (6 * n * h + 4 * h + 20 * n + 4) + 4 * h + 4
