"""Saved bytes of hybrid linear-attention families' layers, per token: term functions.

Read off the fake-tensor trace's saved tensors (`torch.autograd.graph.saved_tensors_hooks`)
module by module, gradient checkpointing off, then checked against `trace_step` on whole tiny
models at held-out shapes (tests/test_plan_mixers.py):

- Gated DeltaNet's torch chunked kernel: see `plan.profiles` (Qwen3-Next's fused in_proj_qkvz
  layout). Qwen4-Exp projects q/k/v, z, b and a separately: the conv reads in_proj_qkv's output
  as is, so the fused layout's concatenated q/k/v copy (2 B per conv channel) and z's copy out
  of the fused output (4 B per value channel) are not kept – at hk 2 and 4 key heads (4 value
  heads × 16) the term then matches the kernel's saved bytes to the byte per token.
- Hyper-connections carry `N` residual streams per token (`hc_count` / `hc_mult`): a layer's
  checkpointed input and the gradient between layers are `N·H` wide, and each of a layer's two
  stream mixers (before the mixer, before the MLP) keeps its own saved set.
- Qwen4-Exp's gated residual: a grouped RMSNorm over the `N·H` streams (fp32 input, 4·N·H, and
  a per-group rstd), its bf16 output and the sigmoid'd mix weights (2·N·H each), the low-rank
  silu (2·r) and the injection weights (2·N); the layer then keeps the block output and the
  weights for each injection product (2·H + 2·N, twice) – checked at N·H = 4 × 64 and 2 × 128.
- Qwen4-Exp's attention: per-head q/k RMSNorms (fp32 q, k + rstd), q, then k and v repeated to
  every head (the causal and the indexer's selection masks make SDPA take a mask), the sigmoid
  output gate (4·q) and the two boolean masks (2 B per pair). Its QSA indexer runs with grad,
  one query at a time, and saves a lot (per pooled block ~8·d + 4·heads + 4·head_dim + 8 B:
  ~26 B per pair at d 16, c 4), but its output is a boolean selection: nothing differentiable
  depends on it, so each query's graph – and what it saved – is freed in the forward, and its
  projection's LoRA keeps nothing (`no_grad`). Counted, it put the gc-off peak 1.0-2.4 % and
  the kept bytes 2.2-5.4 % over the trace on six shapes; without it they are 0.8-2.0 % and
  1.5-4.2 % under, and the index head dims no longer change the result (as in the trace).
- GLM-5-Next's manifold hyper-connections (mHC): the flattened streams' norm in fp32 (4·N·H +
  rstd; the frozen projection after it keeps no input), the 2·iters − 1 Sinkhorn divisions
  (each an N×N fp32 matrix and its N sums), the gates (12·N² + 28·N, fitted) and the bf16
  streams for the collapse (2·N·H); the layer keeps the block output, post and comb for each
  expansion. Fitted at N = 4 with 20 and 10 Sinkhorn iterations (exact to 16 B per token),
  N = 2 / 10 iterations within 3 %. In backward the MLP side's mixer is freed before the
  token mixer's own backward runs, which the gc-on peak (a KDA layer's backward) shows.
- GLM-5-Next's token mixers are the families' own: its KDA (`linear_attention`) is
  kimi_linear's kernel and term (within 0.3 % of the saved bytes), its MLA + pooled indexer the
  DSA term; its SwiGLUs clamp gate and up (experts as gpt_oss's `gate_saved`, and the dense
  and shared MLPs keep 10·I).
"""

from __future__ import annotations

from moetune.model.spec import ModelSpec

DELTA_CHUNK = 64  # torch_chunk_gated_delta_rule's chunk size


def gated_delta_net(spec: ModelSpec) -> int:
    """Gated DeltaNet through the torch chunked kernel, per token (see the module docstring)."""
    c, chunk = spec.hf_config, DELTA_CHUNK
    hv, hk = c["linear_num_value_heads"], c["linear_num_key_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    conv = 2 * hk * dk + hv * dv  # q, k, v channels through the causal conv
    # conv in/out · chunk matrices · q/k/w/u per head · v/out/norm · states · gates and norms
    per_head = 20 * chunk + 32 * dk + 26 * dv + 4 * dk * dv // chunk + 34
    return 4 * conv + hv * per_head


def split_delta_net(spec: ModelSpec) -> int:
    """Gated DeltaNet with separate q/k/v, z projections (Qwen4-Exp): no copies out of a fused
    projection (see the module docstring)."""
    c = spec.hf_config
    conv = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"]
    value = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    return gated_delta_net(spec) - 2 * (conv + value) - 4 * value


def _hc(spec: ModelSpec) -> tuple[int, int]:
    """(streams N, N·H) of a hyper-connected residual."""
    c = spec.hf_config
    streams = int(c.get("hc_count") or c.get("hc_mult") or 1)
    return streams, streams * spec.hidden_size


def hyper_streams(spec: ModelSpec) -> int:
    """Residual streams per token: the width of a checkpoint and of the inter-layer gradient."""
    return _hc(spec)[0]


def gated_residual(spec: ModelSpec, inject: bool = True) -> int:
    """One Qwen4-Exp gated residual mixer: grouped norm (fp32 in + rstd), bf16 normed streams
    and mix weights, the low-rank silu and (with `inject`) the injection weights."""
    n, width = _hc(spec)
    rank = spec.hf_config["hc_lowrank"]
    return 4 * width + 4 * n + 4 * width + 2 * rank + (2 * n if inject else 0)


def gated_residual_layer(spec: ModelSpec) -> int:
    """A Qwen4-Exp layer's two gated residuals and its two injection products."""
    n, _ = _hc(spec)
    return 2 * gated_residual(spec) + 2 * (2 * spec.hidden_size + 2 * n)


def gated_residual_head(spec: ModelSpec) -> int:
    """The final mixer that collapses the streams before the model's norm (no injection)."""
    return gated_residual(spec, inject=False)


def qsa_attention(spec: ModelSpec) -> int:
    """Qwen4-Exp's output-gated qk-norm attention under masked SDPA (its indexer keeps
    nothing: see the module docstring)."""
    heads, kv_heads = spec.num_attention_heads, spec.num_kv_heads
    q, kv = heads * spec.head_dim, kv_heads * spec.head_dim
    sdpa = 2 * 4 * q + 4 * heads  # q, out and k, v repeated to every head; fp32 lse
    norms = 4 * (q + kv) + 4 * (heads + kv_heads)  # fp32 q, k and their rstd
    return sdpa + norms + 4 * q  # + the sigmoid gate's input and output


def qsa_masks(_: ModelSpec) -> int:
    """Per query·key pair: the causal mask and the indexer's selection, boolean."""
    return 2


def mhc(spec: ModelSpec) -> int:
    """One GLM-5-Next manifold hyper-connection (see the module docstring): the flattened
    streams' norm (fp32 in + rstd; the frozen projection keeps no input), the Sinkhorn
    divisions (an N×N fp32 matrix and N sums each), the gates (fitted) and the bf16 streams
    for the collapse."""
    n, width = _hc(spec)
    divisions = 2 * spec.hf_config["hc_sinkhorn_iters"] - 1
    return 4 * width + 4 + divisions * 4 * (n * n + n) + 12 * n * n + 28 * n + 2 * width


def mhc_mlp_side(spec: ModelSpec) -> int:
    """The MLP side's half of `mhc_layer`: freed before the token mixer runs backward."""
    return mhc_layer(spec) // 2


def mhc_layer(spec: ModelSpec) -> int:
    """A GLM-5-Next layer's two mHC mixers and its two expansions (post · out + comb · in):
    the block output, post and comb in bf16."""
    n, _ = _hc(spec)
    return 2 * mhc(spec) + 2 * (2 * spec.hidden_size + 2 * n + 2 * n * n)
