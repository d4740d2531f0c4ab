"""How long a fake-tensor trace will take, said before it starts.

A trace costs its aten op count times what one op costs under `FakeTensorMode` and the
byte tracker; tensor sizes hardly matter (no values are computed). Ops grow with the
layers and, for a mixer whose torch path loops over the tokens in Python (jamba's Mamba
scan, without the mamba-ssm kernels), with the sequence length too: a trace that takes
seconds at seq 16 takes many minutes at seq 2048. `OPS` holds each layer kind's ops per
traced step (fixed, and per token), counted on tiny traces of the census; the seconds an
op takes are this machine's, read off the traces already in the cache (`seconds / ops`),
else `DEFAULT_S_PER_OP`.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass

from moetune.config import RunConfig
from moetune.model.spec import ModelSpec
from moetune.plan.profiles.registry import layer_kinds
from moetune.plan.trace.cache import cache_dir


@dataclass(frozen=True)
class LayerOps:
    """aten ops one decoder layer of a kind dispatches in one traced step (forward,
    backward and, with checkpointing, the recompute), as fixed + per_token·seq_len."""

    fixed: float
    per_token: float = 0.0


# Counted with trace_step's op counter (TraceResult.ops) on the census' tiny 4-layer configs
# at seq 16 and 64, checkpointing on, LoRA r4 on attention + experts (2026-12-02; the
# embedding, loss and optimizer ops are shared out over the layers): qwen3_moe 6,328 ops at
# both lengths; lfm2_moe (2 conv + 2 attention) 5,326; nemotron_h (Mamba2's chunked scan)
# 3,596 and 3,630; jamba 12,484 and 33,988 – 56 per token per Mamba layer, its scan's
# select / mul / add / matmul per token in forward, recompute and backward.
OPS: dict[str, LayerOps] = {
    "attention": LayerOps(791.0),
    "conv": LayerOps(540.0),
    "mamba": LayerOps(450.0),  # Mamba2's chunked torch path: ops per chunk, not per token
}
FAMILY_OPS: dict[str, dict[str, LayerOps]] = {
    "jamba": {"mamba": LayerOps(664.5, 56.0)},  # Mamba1's torch scan: a loop over the tokens
}
DEFAULT_OPS = LayerOps(800.0)  # a kind not counted: an attention layer's order
# ~100k ops of a Qwen3-30B-A3B step in ~20 s on 2 CPU cores (docs/plan.md); the cache's
# own rate (this machine, this load) wins
DEFAULT_S_PER_OP = 2e-4
STEPS = 2  # trace/cache.py's STEPS: the planner traces the steady state


def expected_ops(spec: ModelSpec, cfg: RunConfig) -> float:
    """aten ops the planner's trace of `cfg` on `spec` will dispatch (an estimate)."""
    seq = cfg.train.seq_len
    kinds = layer_kinds(spec) or ("attention",) * spec.num_layers
    counts = [_ops(spec.model_type, k) for k in kinds]
    return STEPS * sum(c.fixed + c.per_token * seq for c in counts)


def _ops(model_type: str, kind: str) -> LayerOps:
    own = FAMILY_OPS.get(model_type, {})
    return own.get(kind) or OPS.get(kind, DEFAULT_OPS)


def seconds_per_op() -> float:
    """This machine's seconds per traced op: the median over the cached traces."""
    rates = []
    for path in sorted(cache_dir().glob("*.json"))[:200]:
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(entry, dict) and (entry.get("ops") or 0) > 1000:
            rates.append(float(entry["seconds"]) / float(entry["ops"]))
    return statistics.median(rates) if rates else DEFAULT_S_PER_OP


def expected_trace_s(spec: ModelSpec, cfg: RunConfig) -> float:
    """Seconds the planner's trace of `cfg` on `spec` is expected to take here."""
    return expected_ops(spec, cfg) * seconds_per_op()
