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
- Inkling2 (`inkling2_text`; `inkling2_loop_text` where no layer falls in its loop range):
  eager attention with a sink column – bf16 q and repeated k, v (6·heads·d), fp32 and bf16
  probabilities (6·heads per pair) and the sink's fp32 column – after l2 clips on q, k and
  the relative states (fp32 input, 4 fp32 per head) and an unweighted RMSNorm on v; the
  output gate keeps the fp32 output and sigmoid (8·heads·d). Sliding layers' k / v convs are
  static (fp32 input); full layers' are dynamic (per-token taps: the fp32 windows and taps,
  2 × 4·kernel per channel) and their q / k / v input norms read the 3-query residual
  (+ 8·H). Every layer stacks the block states so far plus the partial state for its
  attention input (not layer 0) and its MLP input: per stacked state the fp32 cat and its
  normed copy (8·H) – summed over the layers' block counts and averaged. The softcapped
  SwiGLU runs in fp32 (the profile's gate_saved = 26). Read off layers 0, 1 and 3 of the
  census' tiny config; checked against the trace with 2-layer blocks, 8 heads, rel_extent
  256 and hidden 128: peak 1.0–1.7 % under, kept 2.5–4 % over (the trace's recompute in
  the backward keeps ~5 % more than the analytic's checkpointed layer).
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


def _residual_states(spec: ModelSpec) -> tuple[int, int]:
    """Σ over layers of the states Inkling2's attention / MLP input residuals stack (the
    block states so far + the partial one): a block closes every `n_layers_per_attn_res_block`."""
    every, layers = spec.hf_config["n_layers_per_attn_res_block"], spec.num_layers
    before = [0 if i == 0 else (i - 1) // every + 1 for i in range(layers)]
    attention = sum(b + 1 for b in before[1:])  # layer 0 has no attention input
    mlp = sum(b + 1 + (i % every == 0) for i, b in enumerate(before))
    return attention, mlp


def inkling2_residuals(spec: ModelSpec, queries: int) -> int:
    """The block attention residuals, averaged over the layers: per stacked state its fp32
    cat and normed copy (8·H), the rstd and the fp32 weights per query (see the docstring)."""
    attention, mlp = _residual_states(spec)
    per_state = 8 * spec.hidden_size + 4
    total = attention * (per_state + 4 * queries) + mlp * (per_state + 4)
    return total // max(1, spec.num_layers)


def _inkling2(spec: ModelSpec, sliding: bool) -> int:
    """Inkling2's attention, its convolutions and residual inputs, per token."""
    c, h = spec.hf_config, spec.hidden_size
    n, m, d, extent = _inkling_heads(spec, sliding)
    clips = 4 * n * d + 16 * n + 4 * m * d + 16 * m + 4 * m * d + 4 * m  # q, k l2 clips; v norm
    attention = 6 * n * d + 4 * n + 8 * n * d  # eager q, k, v (bf16), sink column, gated out
    bias = 2 * n * extent + 4 * n * c["d_rel"] + 16 * n
    taps = 1 if sliding else 2 * c["conv_kernel_size"]  # full layers' k / v convs: dynamic
    convs = 8 * m * d * taps + 8 * h
    full = 0 if sliding else 8 * h + 8  # q/k/v input norms over the 3-query residual
    return clips + attention + bias + convs + full + inkling2_residuals(spec, 1 if sliding else 3)


def inkling2_full(spec: ModelSpec) -> int:
    return _inkling2(spec, sliding=False)


def inkling2_sliding(spec: ModelSpec) -> int:
    return _inkling2(spec, sliding=True)


def inkling2_pairs(spec: ModelSpec) -> int:
    """Per pair: eager attention's fp32 and bf16 probabilities per head, the bias's int64
    gather index and bool out-of-extent mask."""
    return 6 * spec.num_attention_heads + 9


def no_loop_layers(spec: ModelSpec) -> bool:
    """Inkling2-loop builds no loop layer (its loop range lies past the last layer): each
    layer runs once, as Inkling2's. Loop layers run `loop_num_passes` times with message
    residuals and gates that no term sizes yet, so a build with them keeps the trace."""
    c = spec.hf_config
    return min(c["loop_layer_index_end"], spec.num_layers) <= c["loop_layer_index_start"]
