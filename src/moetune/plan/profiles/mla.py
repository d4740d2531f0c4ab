"""Saved-bytes terms of MLA attention: DeepSeek's MLA and DSA (documented in `plan.profiles`)
and the variants beyond them (hy_v4, longcat_flash).

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
- longcat_flash: each layer holds two MLA sublayers (a ModuleList; DeepSeek's MLA term each,
  its q/kv LoRA scalings are Python floats and keep nothing), two dense SwiGLU MLPs (6·I each:
  gate out, activation, up out) and four RMSNorms. Its MoE routes over the real experts and
  `zero_expert_num` identity experts in one eager loop; routed evenly (as the trace routes),
  a share n / (n + zero) of the k slots per token reaches a real expert and keeps its gathered
  input, gate/up output, activation, down input and output and the weighted product
  (6·H + 8·I with LoRA on the stacks), an identity slot its input and the weighted product
  (4·H); each slot also its fp32 weight and int64 token and slot indices (20 B). transformers
  sizes the gate/up stack for the identity experts too, and peft's W + ΔW of a stack is
  sliced per expert in that loop: in backward each slice's gradient comes back zero-filled to
  the stack's full size and is added to the running sum – three full-size gradients of the
  largest stack at once (the peak op, aten.add), where grouped_mm makes the down stack's one.

Fitted at hidden 64, four heads (the census' tiny configs; longcat_flash with 4 identity
experts beside its 4 real ones) at seq 128 and checked on held-out shapes (hy_v4: N = 2,
hidden 128, 8 heads; longcat_flash: hidden 128, 8 identity experts), see
tests/test_plan_mixers.py's CALIBRATED list. At the census' own longcat_flash config (256
identity experts beside 4 real ones: ~1 token per expert) the peaks stay within 1.3 % but the
kept bytes come out 6 % low.
"""

from __future__ import annotations

from typing import Any

from moetune.model.spec import ModelSpec
from moetune.plan.profiles.hybrid import hyper_streams


def _mla(spec: ModelSpec) -> dict[str, Any]:
    c = spec.hf_config
    return {
        "qk": spec.num_attention_heads * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"]),
        "v": spec.num_attention_heads * c["v_head_dim"],
        "kv_b": spec.num_attention_heads * (c["qk_nope_head_dim"] + c["v_head_dim"]),
        "norms": c.get("kv_lora_rank") or 0,
        "q_norm": c.get("q_lora_rank") or 0,
    }


def _mla_math(spec: ModelSpec) -> bool:
    """No fused CPU kernel takes a v head dim unlike q/k's: SDPA runs the math kernel."""
    m = _mla(spec)
    return bool(m["qk"] != m["v"])


def mla_attention(spec: ModelSpec) -> int:
    """MLA's kv_a / q_a RMSNorms plus its SDPA: the math kernel's fp32 q, k, v, or (equal
    head dims) the fused kernel's bf16 q, k, out, fp32 log-sum-exp per head, and v – a view
    that keeps kv_b_proj's whole output (k_nope and v) alive."""
    m = _mla(spec)
    norms = 4 * (m["norms"] + m["q_norm"])
    if _mla_math(spec):
        return norms + 4 * (2 * m["qk"] + m["v"])
    rstd = 4 * (bool(m["norms"]) + bool(m["q_norm"]))
    return norms + rstd + 2 * (2 * m["qk"] + m["kv_b"] + m["v"]) + 4 * spec.num_attention_heads


def mla_pairs(spec: ModelSpec) -> int:
    """The math kernel's fp32 probabilities, per query·key pair; the fused kernel: none."""
    return 4 * spec.num_attention_heads if _mla_math(spec) else 0


def dsa_pairs(spec: ModelSpec) -> int:
    """MLA's pairs plus DeepSeek sparse attention's top-k mask (bf16, one per layer)."""
    return mla_pairs(spec) + 2


def indexer_scores(spec: ModelSpec) -> int:
    """The indexer's fp32 q·k scores per index head, and their scaled / relu'd copy."""
    return 2 * 4 * spec.hf_config["index_n_heads"]


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


def first_norm(spec: ModelSpec) -> int:
    """The first layer's input norm keeps nothing when its input needs no gradient."""
    return 4 * spec.hidden_size + 4


def dual_mla(spec: ModelSpec) -> int:
    """longcat_flash's two MLA sublayers and two dense MLPs per layer, per token."""
    return 2 * mla_attention(spec) + 2 * 6 * _c(spec, "ffn_hidden_size")


def dual_mla_pairs(spec: ModelSpec) -> int:
    return 2 * mla_pairs(spec)


def zero_expert_routed(spec: ModelSpec, trained: bool) -> int:
    """longcat_flash's routed slots, real experts and identity ones, per token."""
    h, inter, n = spec.hidden_size, _c(spec, "expert_ffn_hidden_size"), _c(spec, "n_routed_experts")
    real = n / (n + _c(spec, "zero_expert_num"))
    # without LoRA on the stacks a real slot keeps neither its input nor the down input
    slot = 6 * h + 8 * inter - (0 if trained else 2 * h + 2 * inter)
    return int(spec.top_k * (real * slot + (1 - real) * 4 * h + 20))
