"""Saved-bytes terms of state-space mixers (Mamba1, Mamba2) and nemotron_h's MLP layers.

Each is read off the saved tensors (`torch.autograd.graph.saved_tensors_hooks`, unique
storages) of one layer whose input needs a gradient, in transformers' torch paths (what
runs without mamba-ssm / causal-conv1d, and what the trace runs):

- Mamba1 (`mamba`: jamba) through `mamba_selective_scan`'s recurrent loop over the tokens:
  the discretised A = exp(A·dt) and B·dt, fp32 per channel and state (8·I·N), and per step
  the fp32 state, which the next step's product keeps, plus its bf16 copy, which the output
  matmul keeps (6·I·N): 14·I·N. Per channel (I = expand·hidden) in_proj's x and z halves,
  the conv's output and activation and the gated output in bf16 (10·I), fp32 dt, x and
  their broadcasts (8·I) and one more bf16 (2·I): 20·I. B and C: the norms' fp32 inputs,
  B in fp32, C in bf16 (14·N); the dt norm's input (4·R) and three rstds (12). Exact on the
  saved tensors at I 128 / 256, N 16 / 32, dt rank 8 / 16, seq 64 / 128; the per-layer
  constants (A, D, the conv's padding, the zero initial state) are left out. Its backward
  adds 16·I·N per token while it runs: the fp32 gradients of the discretised A and B·x, each
  next to the full-size zero-filled gradient of one step's slice (`mamba1_backward`; with
  checkpointing at N 32 this is the peak: the trace's 16.9 MB, 1.85× the plan without it).
- Mamba2 (`mamba`: granitemoehybrid, nemotron_h – the same `mamba2_chunk_scan`, its sizes
  under different field names) through the torch chunked scan: the projections, the conv's
  input and output and the gated RMSNorm per channel (34·I, I = heads·head dim), per chunk of
  C tokens the fp32 C×C decay / C·Bᵀ / masked matrices per head (16·H·C per token) and the
  fp32 H×P×N chunk states (16·I·N / C), B and C repeated to every head in fp32 for the batched
  matmuls (16·H·N), the conv's B and C channels (8·G·N), less 40 per head (what the fit
  leaves). Fitted to the slope over tokens (seq 128 → 256) of the saved tensors of a Mamba2
  layer behind an adapted one, on six shapes (H 4 / 8, P 16 / 32, N 16 / 32, C 32 / 16,
  G 1 / 2): within 0.3 % on each; the pad to a whole chunk and the per-layer constants are
  left out. (Fitted before on layer 0, which keeps nothing without checkpointing, the old
  term came out 25 % low per layer.)
- A dense MLP as a layer's only block (`mlp`: nemotron_h's relu² MLP layers): the up
  projection's output, kept by the activation (2·I); the adapted Linears' inputs are counted
  as every mixer's are.
"""

from __future__ import annotations

from moetune.model.spec import ModelSpec

# config field names of the Mamba2 sizes, by family: (heads, head dim, state, chunk, groups)
MAMBA2_FIELDS = {
    "granitemoehybrid": (
        "mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_chunk_size", "mamba_n_groups",
    ),
    "nemotron_h": ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "chunk_size", "n_groups"),
}  # fmt: skip
MAMBA1_FIELDS = ("mamba_d_state", "mamba_expand", "mamba_dt_rank")


def _mamba2(spec: ModelSpec) -> tuple[int, int, int, int, int]:
    """(heads, head dim, state, chunk, groups), read by the family's field names."""
    c = spec.hf_config
    names = MAMBA2_FIELDS.get(spec.model_type, MAMBA2_FIELDS["granitemoehybrid"])
    heads, dim, state, chunk = (int(c[n]) for n in names[:4])
    return heads, dim, state, chunk, int(c.get(names[4]) or 1)


def mamba1_scan(spec: ModelSpec) -> int:
    """Mamba1 through transformers' torch recurrent scan, per token (see the module docstring)."""
    c = spec.hf_config
    inner, state = c["mamba_expand"] * spec.hidden_size, c["mamba_d_state"]
    rank = c["mamba_dt_rank"]
    if rank == "auto":  # the released configs resolve it at load; a raw one may not
        rank = -(-spec.hidden_size // 16)
    return 14 * inner * state + 20 * inner + 14 * state + 4 * rank + 12


def mamba1_backward(spec: ModelSpec) -> int:
    """Mamba1's backward over the token loop: the fp32 gradients of exp(A·dt) and B·dt·x,
    each accumulating a zero-filled full-size gradient per step's slice (16·I·N)."""
    c = spec.hf_config
    return 16 * c["mamba_expand"] * spec.hidden_size * c["mamba_d_state"]


def dense_mlp_layer(spec: ModelSpec) -> int:
    """An MLP layer's up-projection output, kept by its activation (bf16)."""
    return 2 * spec.hf_config["intermediate_size"]


def mamba2_chunked(spec: ModelSpec) -> int:
    """Mamba2 through transformers' torch chunked scan, per token (see the module docstring)."""
    heads, dim, state, chunk, groups = _mamba2(spec)
    inner = heads * dim
    chunked = heads * chunk + inner * state // chunk  # C×C per head, the chunk states
    return 34 * inner + 16 * chunked + 16 * heads * state + 8 * groups * state - 40 * heads
