"""The speedup the hardware allows split LoRA over peft's ParamWrapper on one experts layer.

An analytic count, per benchmark shape, of the FLOPs and bytes moved by each kernel of
one forward + backward with frozen experts and LoRA rank r on both projections
(gate_up: hidden -> 2·intermediate, down: intermediate -> hidden), S = tokens · top-k
(token, expert) pairs, N = E · in · out weights per projection:

* peft 0.21 `ParamWrapper` (one adapter: `_LoraFactorsProxy`) folds the factors into the
  stack on every forward, `W' = baddbmm(W, B, A)` (reads W, writes W'), and runs the
  experts forward (transformers' `grouped_mm`) on W'. With both stacks adapted the
  wrappers nest, and peft 0.21.2 folds each stack twice per forward (an aten-level trace
  shows four `baddbmm` for two stacks; tests/test_bench_lora_bound.py counts them), one
  of them differentiated. Since W' requires grad, backward
  computes the full weight gradient dW' = xᵀ·g per expert (N written) and from it the
  factor gradients dB = dW'·Aᵀ and dA = Bᵀ·dW' (two reads of dW', 2·N·r FLOPs each).
* split LoRA runs the same grouped base matmuls on W, plus the low-rank path x·A·B
  (and its four backward products) on the S rows, never an N-sized tensor.

Both share the routing gathers, the gate activation and the combine; they are counted
once per side, identically. Each kernel takes max(FLOPs / P, bytes / BW) (a roofline
per kernel), with P this machine's matmul FLOP/s at the case's per-expert shape and
dtype, and BW its copy bandwidth, both measured in the run that times the paths; the
bound is peft's roofline time over split LoRA's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    """One fused experts layer and its LoRA, at a compute dtype."""

    experts: int  # E
    top_k: int
    hidden: int
    intermediate: int  # moe_intermediate_size
    tokens: int
    rank: int
    dtype_bytes: int  # 4 fp32, 2 bf16

    @property
    def pairs(self) -> int:
        return self.tokens * self.top_k

    def projections(self) -> list[tuple[int, int]]:
        """(in, out) of gate_up and down."""
        return [(self.hidden, 2 * self.intermediate), (self.intermediate, self.hidden)]


@dataclass(frozen=True)
class Kernel:
    """One kernel's work: floating-point operations and bytes read + written."""

    name: str
    flops: float
    bytes: float


@dataclass(frozen=True)
class Machine:
    """Measured rates the roofline uses."""

    matmul_flops: float  # FLOP/s of one expert's matmul at the case's shape and dtype
    bandwidth: float  # bytes/s of a large copy (read + write)


def _mm(name: str, m: int, k: int, n: int, shape: Shape, groups: int = 1) -> Kernel:
    """(m × k)·(k × n) per group: its FLOPs and its operands' and result's bytes."""
    elems = groups * (m * k + k * n + m * n)
    return Kernel(name, 2.0 * groups * m * k * n, float(elems * shape.dtype_bytes))


def _rows(name: str, reads: int, writes: int, shape: Shape) -> Kernel:
    """An elementwise / gather kernel: bytes only (its FLOPs are no bound on this shape)."""
    return Kernel(name, 0.0, float((reads + writes) * shape.dtype_bytes))


def base_kernels(shape: Shape) -> list[Kernel]:
    """Grouped base matmuls (forward and input gradient) and the shared row work."""
    s, e, t, h, i = shape.pairs, shape.experts, shape.tokens, shape.hidden, shape.intermediate
    out = []
    for k, n in shape.projections():
        out.append(_mm(f"base fwd {k}->{n}", s // e, k, n, shape, e))
        out.append(_mm(f"base dx {n}->{k}", s // e, n, k, shape, e))
    return [
        *out,
        _rows("dispatch fwd+bwd", t * h + s * h, s * h + t * h, shape),
        _rows("gate act fwd", 2 * s * i, s * i, shape),
        _rows("gate act bwd", 3 * s * i, 2 * s * i, shape),
        _rows("routing weights fwd+bwd", 2 * s * h, 2 * s * h, shape),
        _rows("combine fwd+bwd", s * h + t * h, t * h + s * h, shape),
    ]


FOLDS_PER_FORWARD = 2  # peft 0.21.2 with nested wrappers (module docstring)


def peft_kernels(shape: Shape) -> list[Kernel]:
    """peft's ParamWrapper: fold W + B·A, the experts forward on W', and dW' in backward."""
    s, e, r = shape.pairs, shape.experts, shape.rank
    out = base_kernels(shape)
    for k, n in shape.projections():
        weights = e * k * n
        fold = _mm(f"fold W' {k}->{n}", n, r, k, shape, e)  # B·A, plus W read and W' written
        fold = Kernel(fold.name, fold.flops, fold.bytes + 2 * weights * shape.dtype_bytes)
        out += [fold] * FOLDS_PER_FORWARD
        out.append(_mm(f"dW' {k}->{n}", k, s // e, n, shape, e))
        out.append(_mm(f"dB = dW'·Aᵀ {k}->{n}", n, k, r, shape, e))
        out.append(_mm(f"dA = Bᵀ·dW' {k}->{n}", r, n, k, shape, e))
    return out


def split_kernels(shape: Shape) -> list[Kernel]:
    """Split LoRA: base matmuls on W, the rank-r path on the routed rows, no N-sized tensor."""
    s, e, r = shape.pairs, shape.experts, shape.rank
    m = s // e
    out = base_kernels(shape)
    for k, n in shape.projections():
        out += [
            _mm(f"x·A {k}", m, k, r, shape, e),
            _mm(f"(x·A)·B {n}", m, r, n, shape, e),
            _rows(f"out += lora {n}", 2 * s * n, s * n, shape),
            _mm(f"g·Bᵀ {n}", m, n, r, shape, e),
            _mm(f"dB {n}", r, m, n, shape, e),
            _mm(f"dA {k}", k, m, r, shape, e),
            _mm(f"dx += d·Aᵀ {k}", m, r, k, shape, e),
            _rows(f"dx add {k}", 2 * s * k, s * k, shape),
        ]
    return out


def totals(kernels: list[Kernel]) -> tuple[float, float]:
    """(FLOPs, bytes) of a path."""
    return sum(k.flops for k in kernels), sum(k.bytes for k in kernels)


def roofline_s(kernels: list[Kernel], machine: Machine) -> float:
    """Seconds if each kernel ran at the machine's matmul rate or its bandwidth, whichever binds."""
    return sum(max(k.flops / machine.matmul_flops, k.bytes / machine.bandwidth) for k in kernels)


def bound(shape: Shape, machine: Machine) -> dict[str, float]:
    """Both paths' FLOPs, bytes and roofline seconds, and the speedup they allow."""
    peft, split = peft_kernels(shape), split_kernels(shape)
    (pf, pb), (sf, sb) = totals(peft), totals(split)
    peft_s, split_s = roofline_s(peft, machine), roofline_s(split, machine)
    return {
        "peft_gflop": round(pf / 1e9, 1),
        "peft_gb": round(pb / 1e9, 2),
        "split_gflop": round(sf / 1e9, 1),
        "split_gb": round(sb / 1e9, 2),
        "peft_roofline_s": round(peft_s, 3),
        "split_roofline_s": round(split_s, 3),
        "bound_speedup": round(peft_s / split_s, 2),
    }


def measure_machine(shape: Shape, dtype: torch.dtype, repeats: int = 3) -> Machine:
    """Matmul FLOP/s at one expert's gate_up forward (its routed rows × hidden × 2·intermediate)
    and copy bandwidth over 256 MiB (well beyond any cache), medians of `repeats`."""
    k, n = shape.projections()[0]
    x = torch.randn(shape.pairs // shape.experts, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    src = torch.empty(2**28 // shape.dtype_bytes, dtype=dtype).fill_(1.0)
    dst = torch.empty_like(src)
    flops = _rate(lambda: F.linear(x, w), 2.0 * x.shape[0] * k * n, repeats)
    bandwidth = _rate(lambda: dst.copy_(src), 2.0 * src.nbytes, repeats)
    return Machine(flops, bandwidth)


def _rate(work: Callable[[], Any], amount: float, repeats: int) -> float:
    """`amount` per second of `work()`: median over repeats after one warm-up call."""
    work()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return amount / statistics.median(times)
