"""benchmarks/lora_bound.py: its FLOP counts are what peft's ParamWrapper path and the
split-LoRA engine really run (every matmul seen at the aten level on a tiny layer), and the
bound on the benchmark's layer shape follows from them."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import experts_lora as bench
import lora_bound

TINY = bench.Case("layer", True, experts=8, hidden=64, intermediate=32, top_k=2, tokens=64,
                  rank=8)  # fmt: skip  # rank 8: no padding on the split path


class _MatmulFlops(TorchDispatchMode):
    """2·m·k·n summed over every (grouped / batched) matmul the step runs."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__
        # bmm, mm: (…, m, k)·(…, k, n); baddbmm's input first; _grouped_mm: 2-D × 3-D, or
        # 2-D × 2-D (a weight gradient): 2·(elements of a)·n either way
        operands = {"baddbmm.default": args[1:3], "bmm.default": args[:2], "mm.default": args[:2],
                    "_grouped_mm.default": args[:2]}.get(name)  # fmt: skip
        if operands is not None:
            self.flops += 2 * operands[0].numel() * operands[1].shape[-1]
        return func(*args, **(kwargs or {}))


def _counted(side: str) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        models = bench.build_models(TINY, ["fp32"], "off", torch.device("cpu"), torch.float32)
    inputs = bench.make_inputs(TINY, torch.device("cpu"), torch.float32)
    sides = bench.make_sides(models, TINY, ["fp32"], inputs)
    sides[side].activate()
    with _MatmulFlops() as mode:
        sides[side].step()
    return mode.flops


@pytest.mark.parametrize(("side", "kernels"), [("peft", lora_bound.peft_kernels),
                                               ("fp32", lora_bound.split_kernels)])  # fmt: skip
def test_flops_are_what_each_path_runs(side: str, kernels: Any) -> None:
    shape = bench.bound_shape(TINY, torch.float32)
    assert lora_bound.totals(kernels(shape))[0] == _counted(side)


def test_layer_shape_flops_by_hand() -> None:
    shape = bench.bound_shape(bench.CASES["layer"], torch.float32)
    s, e, r = 4096 * 8, 128, 16
    weights = e * (2048 * 1536 + 768 * 2048)  # both stacks' N
    base = 2 * s * (2048 * 1536 + 768 * 2048)  # one pass through both projections
    lora = 2 * s * r * (2048 + 1536 + 768 + 2048)  # x·A and (x·A)·B, both projections
    peft_flops, peft_bytes = lora_bound.totals(lora_bound.peft_kernels(shape))
    split_flops, split_bytes = lora_bound.totals(lora_bound.split_kernels(shape))
    assert peft_flops == 3 * base + (2 + 2) * 2 * weights * r  # fwd, dx, dW'; 2 folds, dA, dB
    assert split_flops == 2 * base + 3 * lora  # fwd and dx; the low-rank path 3× (fwd, 2 grads)
    # peft's own traffic is weight-sized: each of 2 folds reads W, writes B·A and W'; dW'
    # written once and read by dA and dB: 9·N elements (+ dW's inputs, the small factors)
    extra = peft_bytes - lora_bound.totals(lora_bound.base_kernels(shape))[1]
    assert 9 * weights * 4 <= extra < 9.5 * weights * 4
    assert split_bytes < peft_bytes / 2


def test_bound_from_rates() -> None:
    shape = bench.bound_shape(bench.CASES["layer"], torch.bfloat16)
    compute = lora_bound.bound(shape, lora_bound.Machine(1e12, 1e15))  # matmuls bind
    flops = compute["peft_gflop"] / compute["split_gflop"]
    assert compute["bound_speedup"] == pytest.approx(flops, rel=0.01)
    memory = lora_bound.bound(shape, lora_bound.Machine(1e18, 1e10))  # bytes bind
    moved = memory["peft_gb"] / memory["split_gb"]
    assert memory["bound_speedup"] == pytest.approx(moved, rel=0.01)
