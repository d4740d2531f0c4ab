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
  term returns that share.
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
