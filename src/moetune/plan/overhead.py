"""Memory a run needs beyond its live tensors: stated term by term, never folded in.

A live-tensor peak (trace or analytic) is what `torch.cuda.max_memory_allocated` would
report. A card must also hold:

- `cuda_context` – the CUDA context and the kernels it loads (torch, cuBLAS, cuDNN, NCCL
  stubs) with lazy module loading (default since CUDA 11.7): ≈ 0.5 GiB on Hopper with
  torch 2.x, outside the caching allocator (nvidia-smi minus `memory_reserved`).
- `cublas_workspace` – cuBLAS / cuBLASLt workspaces, 32 MiB each on Hopper, taken from
  the caching allocator on first use.
- `allocator` – the caching allocator's reserve beyond live tensors: size-class rounding,
  blocks split and cached between the step's very different tensor sizes (1.2 GB expert
  stacks next to 8 MB activations). Modelled as a fraction of the live peak, calibrated
  on one measured run (below); `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`
  usually shrinks it.

Calibration: Qwen3-30B-A3B, vanilla peft (automap) bf16 LoRA r=16 on attention+experts,
seq 2048, batch 1, gradient checkpointing on, fused AdamW. A real run measured ≈ 85 GB at
`torch.cuda.max_memory_reserved` level; the trace's steady-state live peak (step 2,
Adam moments live) for the same step is `CALIBRATION_LIVE_BYTES`. The allocator fraction
is what is left of the reserve after the workspaces, per live byte.

Apple (MPS) has no CUDA context or cuBLAS; the OS share of unified memory is already
out of the card's usable figure (the Metal working set). Its allocator also caches and
bins blocks; the CUDA fraction is used as the best available estimate. DGX Spark is
unified memory but a CUDA device: every term applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moetune.plan.hardware import Card

MiB = 1024**2
CUDA_CONTEXT_BYTES = 512 * MiB
CUBLAS_WORKSPACE_BYTES = 2 * 32 * MiB
# Measured here (torch 2.13 CPU, transformers 5.24, TRL, RESULTS.md): tiny-model training
# processes, whose own tensors are < 10 MiB, peak at 562–651 MiB RSS (imports alone 486);
# `moetune train` itself (CLI, TRL trainer, tokenizer, dataset) on a 4.5 MB model: 533 MiB.
CPU_PROCESS_BASELINE = 600 * MiB
CALIBRATION_RESERVED_BYTES = 85_000_000_000  # measured max_memory_reserved (≈ 85 GB)
CALIBRATION_LIVE_BYTES = 79_023_709_448  # trace_step, steps=2, same step (73.6 GiB)
ALLOCATOR_FRACTION = (
    CALIBRATION_RESERVED_BYTES - CALIBRATION_LIVE_BYTES - CUBLAS_WORKSPACE_BYTES
) / CALIBRATION_LIVE_BYTES


@dataclass(frozen=True)
class Overhead:
    """Bytes beyond the live peak, by term (each documented in the module docstring)."""

    terms: dict[str, int]
    kind: str  # the card kind these terms are for

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "total": self.total, "terms": dict(self.terms)}


def _cuda(live_bytes: int) -> dict[str, int]:
    return {
        "cuda_context": CUDA_CONTEXT_BYTES,
        "cublas_workspace": CUBLAS_WORKSPACE_BYTES,
        "allocator": round(ALLOCATOR_FRACTION * live_bytes),
    }


def _mps(live_bytes: int) -> dict[str, int]:
    return {"allocator": round(ALLOCATOR_FRACTION * live_bytes)}


def _cpu(live_bytes: int) -> dict[str, int]:
    """A CPU card's process beside its tensors (plan.offload.memory.CPU_PROCESS_BASELINE, measured
    there: torch, transformers, TRL, the CLI); glibc's allocator is not modelled."""
    return {"process_baseline": CPU_PROCESS_BASELINE}


_BY_KIND = {"cuda": _cuda, "unified": _cuda, "mps": _mps, "cpu": _cpu}


def overhead_for(kind: str, live_bytes: int) -> Overhead:
    """The overhead a card of `kind` ("cuda", "unified", "mps", "cpu") adds to
    `live_bytes`."""
    return Overhead(_BY_KIND[kind](live_bytes), kind)


def card_overhead(card: Card, live_bytes: int) -> Overhead:
    return overhead_for(card.kind, live_bytes)
