"""Token-mixer terms of attention that carries its own convolutions or experts (profiles'
registry imports these; each is bytes autograd keeps per token, or per query·key pair).

Read off a real bf16 CPU forward of the peft model with `saved_tensors_hooks` (each saved
tensor attributed to the module that ran it, parameters and W+ΔW copies left out) and
checked against the fake-tensor trace at several tiny shapes, one held out of the fit.

- JetMoE's mixture of attention (`jetmoe`): q and o are expert stacks (MoA, k experts per
  token), k/v one Linear whose heads are repeated k times. Per token it keeps the router's
  top-k indices, fp32 gates and sorted indices (20·k), the gathered input and the mapped
  queries (2·k·H + 2·k·e, e = kv heads × head dim), SDPA's q, repeated k, v and output
  (8·k·e) and fp32 log-sum-exp per head, the reduce's gathered input (2·k·e) and gated
  output (4·k·H with its index), and the gates (2·k): 12·k·e + 6·k·H + 4·heads + 30·k.
  The spec reads both stacks of the layer as routed experts, so its expert width is
  I + 2e/3 and the routed-experts term counts 8·k·(width − I) the MLP never keeps: the
  term returns that share. Checked at 5 shapes (kv_channels 64, 4 kv heads, hidden 128,
  top-3 held out): peak within 1.2 %, what 64 more tokens keep within 1.2 %.
- Inkling (`inkling_text`, kind `conv`): every layer is relative-bias attention between
  short convolutions that run in fp32 (k and v after their projections, and the attention
  and MLP outputs before their residuals: each keeps its fp32 input, 4·width). The q/k
  RMSNorms keep fp32 inputs and rstd; SDPA gets the bias as a float mask, so the math
  kernel runs in fp32: q and the repeated k, v (12·heads·d) and the probabilities
  (4·heads per pair). The bias keeps its projected logits over the whole extent
  (2·heads·extent per token: rel_extent on full layers, the window on sliding ones), an
  int64 gather index and a bool out-of-extent mask per pair. Its shared experts are bmm
  stacks the spec reads no width for (input, gate/up outputs, activation and gamma
  products: 2·H + 10·shared·I) and its router keeps an fp32 logsigmoid/softmax chain over
  top-k + shared logits (20 per slot). Read off layers 1 and 3 of the census' tiny config
  (seq 128) and checked against the trace at hidden 128, 8 heads, rel_extent 256 and window
  64: kept within 3.4 %, peak within 1.6 % (the trace keeps ~40 kB per layer more, in part
  not growing with tokens).
"""

from __future__ import annotations

from moetune.model.spec import ModelSpec

GLU_KEPT = 8  # × k·I: the analytic's gated-experts bytes (ActivationProfile.gate_saved)


def jetmoe_moa(spec: ModelSpec) -> int:
    """JetMoE's mixture-of-attention layer, per token (see the module docstring)."""
    c, k, h = spec.hf_config, spec.top_k, spec.hidden_size
    e = c["num_key_value_heads"] * c["kv_channels"]
    kept = 12 * k * e + 6 * k * h + 4 * spec.num_attention_heads + 30 * k
    return kept - GLU_KEPT * k * (spec.expert_intermediate_size - c["intermediate_size"])


def _inkling_heads(spec: ModelSpec, sliding: bool) -> tuple[int, int, int, int]:
    """(heads, kv heads, head dim, relative-bias extent) of Inkling's full / sliding layers."""
    c = spec.hf_config
    if sliding:
        return (c["swa_num_attention_heads"], c["swa_num_key_value_heads"], c["swa_head_dim"],
                c["sliding_window_size"])  # fmt: skip
    return c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rel_extent"]


def _inkling(spec: ModelSpec, sliding: bool) -> int:
    """Inkling's attention and short convs, per token (see the module docstring)."""
    n, m, d, extent = _inkling_heads(spec, sliding)
    norms = 4 * (n * d + n) + 4 * (m * d + m)  # q/k RMSNorms: fp32 inputs and rstd
    convs = 8 * m * d + 8 * spec.hidden_size  # k, v and the two residual convs, fp32 inputs
    attention = 12 * n * d + 2 * n * extent  # math SDPA's fp32 q, k, v; relative logits
    return norms + convs + attention + inkling_shared(spec)


def inkling_shared(spec: ModelSpec) -> int:
    """Inkling's shared experts (bmm stacks scaled by their router gammas, which the spec
    reads no width for) and its router's fp32 top-k + shared logit chain, per token,
    averaged over the layers (dense layers run a plain MLP, which the analytic sizes)."""
    c, h, k = spec.hf_config, spec.hidden_size, spec.top_k
    shared, inter = c.get("n_shared_experts") or 0, c["moe_intermediate_size"]
    per_moe = 2 * h + 10 * shared * inter + 2 * shared + 20 * (k + shared)
    return per_moe * len(spec.moe_layers) // max(1, spec.num_layers)


def inkling_full(spec: ModelSpec) -> int:
    return _inkling(spec, sliding=False)


def inkling_sliding(spec: ModelSpec) -> int:
    return _inkling(spec, sliding=True)


def inkling_pairs(spec: ModelSpec) -> int:
    """Per query·key pair: the math kernel's fp32 probabilities per head, the relative
    bias's int64 gather index and its bool out-of-extent mask (one per layer)."""
    return 4 * spec.num_attention_heads + 9
