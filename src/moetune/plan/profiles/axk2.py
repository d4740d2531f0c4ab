"""axk2's terms beside DeepSeek sparse attention (`plan.profiles` composes them with MLA's).

Read off the saved tensors (`torch.autograd.graph.saved_tensors_hooks`, layer by layer) of
transformers 5.24's AXK2DecoderLayer as the trace runs it; its MLA and DSA indexer keep what
the DSA term sizes (no q_b_proj: q_gate_proj reads q_a's normed and raw outputs, both kept
only as adapter inputs), and on top:

- the output gate: `attn_output * sigmoid(gate.float())` keeps the bf16 attention output and
  the fp32 sigmoid (2 + 4 B per value channel);
- each gated RMSNorm (`AXK2GatedRMSNorm`: y = RMSNorm(x), y · sigmoid(fc2(silu(fc1(y))))) keeps,
  beyond the plain norm's fp32 input, y in bf16, the fp32 sigmoid and the SiLU's bf16 input
  (6·H + 2·rank per token; fc1 / fc2's adapter inputs are counted as every Linear's). The
  input norm is gated in every layer, the post-attention norm only in MoE layers.

Checked against `trace_step` (seq 128 unless said; kept = gc off − gc on, and the peaks) on
the census shape (4 heads, equal q/k and v head dims: the fused kernel; kept −0.4 %), at seq
256 (+0.4 %), with v_head_dim 8 (the math kernel: +2.9 %), 8 heads (−0.4 %) and held out at
hidden 128 with a gated-norm rank of 32 (+0.2 %); peaks within 0.6 %.
"""

from __future__ import annotations

from moetune.model.spec import ModelSpec


def output_gate(spec: ModelSpec) -> int:
    """The sigmoid gate on the attention output: bf16 output + fp32 sigmoid per channel."""
    return 6 * spec.num_attention_heads * spec.hf_config["v_head_dim"]


def gated_norm(spec: ModelSpec) -> int:
    """One gated RMSNorm beyond a plain one: y (bf16), its fp32 sigmoid gate, SiLU's input."""
    return 6 * spec.hidden_size + 2 * spec.hf_config["gated_norm_rank"]
