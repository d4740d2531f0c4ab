"""Step time of an offloaded run on a CPU "card" (this host, `plan.host`), from its rates.

Per micro-batch each MoE layer runs in every phase (forward, the recompute when gradient
checkpointing is on, backward: the input gradient needs the frozen weights). In a phase a
layer's stacks are read from disk while the previous layer computes (a one-layer
prefetch), so the phase takes max(read, CPU) per layer:

- read = the layer's file bytes / (disk rate × `STREAM_EFFICIENCY`); offload cpu reads
  nothing (the stacks already are in the RAM the CPU computes from);
- CPU = widening (a bf16 file computed in fp32: the bf16 bytes read and the fp32 bytes
  written, at the memory's traffic rate) + the expert matmuls, each the larger of its FLOPs
  at the measured matmul rate and the bytes of the experts it touches read at that rate (a
  few tokens per expert: memory-bound). The traffic rate is twice the memcpy figure
  `doctor --calibrate` stores: a copy of N bytes reads N and writes N.

The rest of the model (attention, router, shared experts, head) adds the same roofline
(its FLOPs, or its weights read once a phase), outside the overlap. The widening and the
matmuls share the cores; the disk read does not (O_DIRECT is DMA).
"""

from __future__ import annotations

from dataclasses import dataclass

from moetune.config import RunConfig
from moetune.config.keys import offload_mode
from moetune.model.spec import ModelSpec
from moetune.plan.cost.estimate import flops_per_token
from moetune.plan.hardware import Card, HostRates

# The offload reader (engine/direct_io) handed over 0.77–1.12× the O_DIRECT rate `read_rate`
# measures, in 4 interleaved rounds on this VM (benchmarks/offload_stream.py,
# benchmarks/results/offload-and-stored.md); a plan takes 0.9. Assumed from that benchmark,
# not fitted to a training run.
STREAM_EFFICIENCY = 0.9


@dataclass(frozen=True)
class CpuStep:
    """One optimizer step's time on a CPU, in seconds."""

    read_s: float  # the stream's disk reads, all phases
    cpu_s: float  # everything the cores do: widening, expert matmuls, the rest
    step_s: float  # Σ max(read, CPU) per layer and phase, plus the rest


def cpu_step(
    spec: ModelSpec, cfg: RunConfig, card: Card, file_layer: int, layer: int
) -> CpuStep:  # fmt: skip
    """`cfg`'s step on `card`: `file_layer` bytes read, `layer` bytes computed per layer."""
    rates = card.rates
    assert rates is not None, "a CPU card carries its rates"
    passes = cfg.train.grad_accum * len(spec.moe_layers) * _phases(cfg)
    read = _read_s(cfg, rates, file_layer)
    cpu = _widen_s(rates, file_layer, layer) + _experts_s(spec, cfg, rates, layer)
    rest = _rest_s(spec, cfg, rates)
    return CpuStep(passes * read, passes * cpu + rest, passes * max(read, cpu) + rest)


def _phases(cfg: RunConfig) -> int:
    return 3 if cfg.train.gradient_checkpointing else 2


def _read_s(cfg: RunConfig, rates: HostRates, file_layer: int) -> float:
    if not offload_mode(cfg.train.offload).on_disk:
        return 0.0
    return file_layer / (rates.disk_read_gb_per_s * 1e9 * STREAM_EFFICIENCY)


def _traffic(rates: HostRates) -> float:
    """Bytes per second the memory moves (reads + writes): a memcpy moves each byte twice."""
    return 2 * rates.memcpy_gb_per_s * 1e9


def _widen_s(rates: HostRates, file_layer: int, layer: int) -> float:
    """A file read narrower than it computes is widened into the compute copy."""
    return (file_layer + layer) / _traffic(rates) if layer > file_layer else 0.0


def _experts_s(spec: ModelSpec, cfg: RunConfig, rates: HostRates, layer: int) -> float:
    """One layer's routed expert matmuls in one phase of one micro-batch (roofline)."""
    tokens = cfg.train.seq_len * cfg.train.batch_size
    per_expert = 3 * spec.hidden_size * spec.expert_intermediate_size
    flops = 2.0 * tokens * spec.top_k * per_expert
    touched = min(spec.num_experts, tokens * spec.top_k) / max(spec.num_experts, 1)
    return max(flops / _flop_rate(cfg, rates), touched * layer / _traffic(rates))


def _rest_s(spec: ModelSpec, cfg: RunConfig, rates: HostRates) -> float:
    """Everything but the routed experts, as a roofline too: its FLOPs at the matmul rate,
    or its weights (embeddings aside: a lookup reads a few rows) read once a phase at the
    memory's rate – with few tokens the attention and head matmuls are memory-bound."""
    routed = len(spec.moe_layers) * spec.top_k * 3 * spec.hidden_size
    rest = max(spec.active_params - routed * spec.expert_intermediate_size, 0)
    tokens = cfg.train.seq_len * cfg.train.batch_size * cfg.train.grad_accum
    flops = tokens * flops_per_token(rest, cfg.train.gradient_checkpointing)
    c = spec.components
    weights = (c.total - c.routed_experts - c.embeddings) * _compute_bytes(cfg)
    reads = cfg.train.grad_accum * _phases(cfg) * weights
    return max(flops / _flop_rate(cfg, rates), reads / _traffic(rates))


def _compute_bytes(cfg: RunConfig) -> int:
    return 2 if cfg.train.precision == "bf16" else 4


def _flop_rate(cfg: RunConfig, rates: HostRates) -> float:
    """bf16 matmuls when the run computes in bf16; fp32 otherwise (a CPU's auto)."""
    return rates.gflops(_compute_bytes(cfg)) * 1e9
