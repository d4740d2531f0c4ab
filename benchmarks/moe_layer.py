"""One Qwen3-30B-A3B MoE layer, LoRA r on its experts: forward + backward time and peak bytes
of split LoRA against peft's ParamWrapper paths – the layer table nobody publishes.

The layer is transformers' own `Qwen3MoeSparseMoeBlock` (router + fused experts) built from a
`Qwen3MoeConfig` at the published widths (128 experts, top-8, hidden 2048,
moe_intermediate 768), random weights (seeded, std 0.02 as transformers initialises them),
with peft's LoRA (`target_parameters`: gate_up_proj, down_proj; r 16, alpha 32, B non-zero as
after some training) injected by `peft.inject_adapter_in_model`. Every path below runs on
that one set of frozen weights (the copies share the parameters) with the same LoRA values
and the same input; the router is real, so all paths see the same routing:

  split           moetune's split LoRA: the experts config selects "moetune_lora"
                  (engine/experts_lora.py), whose registration hook switches peft's wrappers
  peft            peft's ParamWrapper on transformers' eager experts loop, as installed (peft
                  ≥ 0.21.2 folds W + s·B·A into one `baddbmm` per stack, `_LoraFactorsProxy`)
  peft_unfolded   the same without the fold: ΔW materialised, then W + ΔW (peft's
                  `_LoraParameterProxy`, its path for several adapters or FP8 weights, and
                  its only path before the fold); only where the installed peft has the fold
  peft_grouped_mm peft's ParamWrapper under transformers' `experts_implementation=
                  "grouped_mm"` (integrations/moe.py; one grouped GEMM per projection)

A path the installed peft / transformers lack is listed as absent, with why.

Time: median of `--repeats` forward + backward steps after one warm-up (the memory pass), the
paths alternating per repeat so a change in the machine's load hits all alike. Peak extra
bytes: on CUDA `torch.cuda.max_memory_allocated()` minus what was allocated before the step;
on CPU the live tensor bytes the step adds (`moetune.plan.trace.bytes.ByteTracker`) – both as
benchmarks/experts_lora.py measures them (its helpers are reused). Agreement: each path's
layer output and LoRA gradients against peft's, as relative norms; `--smoke` (tiny widths,
fp32, CPU) fails when any exceeds 1e-4 – that check is the test (tests/test_benchmarks.py).

The whole table runs on CUDA in bf16 (benchmarks/gpu_validate.py runs it as its "moe-layer"
case and `--record-from` records it here); on a CPU, fp32 unless `--dtype bf16`, and
`--tokens` / `--quick` (32 experts, hidden 512, intermediate 256) bring it to a size the host holds
(the full widths in bf16 at 512 tokens did not finish in 400 s on 2 shared cores).

    python benchmarks/moe_layer.py [--quick] [--tokens 4096,16384] [--repeats N]
        [--device cpu|cuda] [--dtype fp32|bf16] [--json] [--record] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import statistics
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import bench_env
import torch

# Siblings: `python benchmarks/moe_layer.py` puts benchmarks/ first on sys.path.
from experts_lora import dtype_name, machine, peak_extra, rel_diff, timed

from moetune.engine import IMPLEMENTATION, is_split, register

RESULTS = bench_env.results_page("engine")
SECTION = "## One Qwen3-30B-A3B MoE layer: split LoRA, peft, grouped_mm (`benchmarks/moe_layer.py`)"
ABOUT = (
    "`python benchmarks/moe_layer.py`: transformers' `Qwen3MoeSparseMoeBlock` (router + fused "
    "experts, random seeded weights), LoRA r on gate_up_proj and down_proj, forward + backward "
    "with the input requiring grad. ms = median step; peak = bytes the step adds above the "
    "frozen weights (CUDA: max_memory_allocated; CPU: live tensor bytes by ByteTracker); "
    "×split = the path's time (peak) over split LoRA's; diff = relative norm of its output "
    "(worst LoRA gradient) against peft's."
)
SMOKE_TOLERANCE = 1e-4  # fp32: every path computes the same sums, in other orders
EXPERT_PARAMS = ["experts.gate_up_proj", "experts.down_proj"]
PEFT = "peft"  # the reference every path is compared with


@dataclass(frozen=True)
class Shape:
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    rank: int


FULL = Shape(128, 8, 2048, 768, 16)  # Qwen3-30B-A3B's MoE layer
QUICK = Shape(32, 8, 512, 256, 16)
SMOKE = Shape(8, 2, 64, 32, 4)
TOKENS = {"full": (4096, 16384), "quick": (1024,), "smoke": (128,)}


# ---------------------------------------------------------------- the paths


def missing_paths() -> dict[str, str]:
    """Paths the installed peft / transformers lack, with why (they are not run)."""
    from importlib import metadata

    from peft.tuners.lora import layer
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    gone = {}
    if not hasattr(layer, "_LoraFactorsProxy"):
        gone["peft_unfolded"] = (
            f"peft {metadata.version('peft')} has no baddbmm fold: its ParamWrapper (the peft "
            "row) already materialises W + ΔW"
        )
    if "grouped_mm" not in ALL_EXPERTS_FUNCTIONS:
        gone["peft_grouped_mm"] = (
            f"transformers {metadata.version('transformers')} has no grouped_mm experts path"
        )
    return gone


@contextlib.contextmanager
def unfolded() -> Iterator[None]:
    """peft's ParamWrapper without its baddbmm fold: ΔW = s·lhs·rhs materialised and added
    by peft's own `_LoraParameterProxy` (the fold's factors are exactly ΔW's)."""
    from peft.tuners.lora import layer

    fold = layer._LoraFactorsProxy

    def delta_proxy(lhs: torch.Tensor, rhs: torch.Tensor, scaling: float) -> Any:
        return layer._LoraParameterProxy(torch.bmm(lhs, rhs) * scaling)

    layer._LoraFactorsProxy = delta_proxy
    try:
        yield
    finally:
        layer._LoraFactorsProxy = fold


def experts_impl(path: str) -> str:
    return {"split": IMPLEMENTATION, "peft_grouped_mm": "grouped_mm"}.get(path, "eager")


def base_block(shape: Shape, device: torch.device, dtype: torch.dtype) -> Any:
    """transformers' Qwen3-MoE layer at `shape`, random weights (seeded, std 0.02)."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = transformers.Qwen3MoeConfig(
        hidden_size=shape.hidden, moe_intermediate_size=shape.intermediate,
        num_experts=shape.experts, num_experts_per_tok=shape.top_k, norm_topk_prob=True,
    )  # fmt: skip
    config._experts_implementation = "eager"
    block = Qwen3MoeSparseMoeBlock(config).to(device, dtype)
    gen = torch.Generator(device).manual_seed(0)  # seeded on the device: no host copy of 1 GB
    with torch.no_grad():
        for param in block.parameters():  # built with torch.empty
            param.normal_(std=config.initializer_range, generator=gen)
    return block.requires_grad_(False)


def with_lora(base: Any, path: str, shape: Shape) -> Any:
    """A copy of `base` sharing its frozen weights, peft's LoRA injected, on `path`."""
    from peft import LoraConfig, inject_adapter_in_model

    block = copy.deepcopy(base, memo={id(p): p for p in base.parameters()})
    block.experts.config = copy.deepcopy(base.experts.config)
    block.experts.config._experts_implementation = experts_impl(path)
    register()  # "moetune_lora" in transformers' interface; switches wrappers on arrival
    lora = LoraConfig(r=shape.rank, lora_alpha=2 * shape.rank, target_parameters=EXPERT_PARAMS)
    block = inject_adapter_in_model(lora, block)
    if is_split(block) != (path == "split"):  # a row under the wrong name is worse than none
        raise SystemExit(f"moe_layer: the {path} block did not get the path it names")
    return block


def lora_params(block: Any) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in block.named_parameters() if p.requires_grad}


def build(shape: Shape, paths: list[str], device: torch.device, dtype: torch.dtype) -> dict:
    """One block per path over the same frozen weights, each with the same LoRA values."""
    base = base_block(shape, device, dtype)
    blocks = {p: with_lora(base, p, shape) for p in paths}
    gen = torch.Generator().manual_seed(2)
    values = {n: torch.randn(p.shape, generator=gen) * (0.02 if "lora_B" in n else 0.1)
              for n, p in lora_params(blocks[paths[0]]).items()}  # fmt: skip
    for block in blocks.values():
        params = lora_params(block)
        assert params.keys() == values.keys(), "paths differ in their LoRA parameters"
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(values[name])
    return blocks


# ---------------------------------------------------------------- one step


@dataclass
class Side:
    block: Any
    step: Callable[[], torch.Tensor]


def make_side(block: Any, path: str, inputs: list[torch.Tensor]) -> Side:
    hidden, grad = inputs

    def step() -> torch.Tensor:
        block.zero_grad(set_to_none=True)
        hidden.grad = None
        with unfolded() if path == "peft_unfolded" else contextlib.nullcontext():
            out = block(hidden)
            out.backward(grad)
        return out.detach()

    return Side(block, step)


def make_inputs(tokens: int, shape: Shape, device: torch.device, dtype: torch.dtype) -> list:
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, tokens, shape.hidden, generator=gen).to(device, dtype)
    grad = torch.randn(1, tokens, shape.hidden, generator=gen).to(device, dtype)
    return [hidden.requires_grad_(True), grad]


def grads(block: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in lora_params(block).items()}


def grad_diff(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """The worst LoRA gradient's relative norm against the reference's."""
    return max(rel_diff(got[n], ref[n]) for n in ref)


def measure(blocks: dict[str, Any], tokens: int, shape: Shape, repeats: int,
            device: torch.device, dtype: torch.dtype) -> list[dict]:  # fmt: skip
    """One row per path at `tokens`: time, peak extra bytes, agreement with peft's."""
    paths = list(blocks)
    inputs = make_inputs(tokens, shape, device, dtype)
    sides = {p: make_side(blocks[p], p, inputs) for p in paths}
    first = {p: peak_extra(s.step, s.block, inputs, device) for p, s in sides.items()}
    got = {p: (first[p][1], grads(sides[p].block)) for p in paths}
    times: dict[str, list[float]] = {p: [] for p in paths}
    for _ in range(repeats):
        for p, side in sides.items():
            times[p].append(timed(side.step, device))
    ref_out, ref_grads = got[PEFT]
    return [
        {
            "path": p, "tokens": tokens, "shape": asdict(shape), "dtype": dtype_name(dtype),
            "ms": round(1000 * statistics.median(times[p]), 2),
            "peak_extra_bytes": first[p][0],
            "output_rel_diff": rel_diff(got[p][0], ref_out),
            "grad_rel_diff": grad_diff(got[p][1], ref_grads),
            "repeats": repeats,
        }
        for p in paths
    ]  # fmt: skip


# ---------------------------------------------------------------- output and record


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's time and peak over split LoRA's at the same token count."""
    split = {r["tokens"]: r for r in rows if r["path"] == "split"}
    for row in rows:
        ours = split.get(row["tokens"])
        if ours:
            row["time_vs_split"] = round(row["ms"] / ours["ms"], 2)
            peak = row["peak_extra_bytes"] / max(ours["peak_extra_bytes"], 1)
            row["peak_vs_split"] = round(peak, 2)
    return rows


def table(rows: list[dict], absent: dict[str, str]) -> str:
    lines = ["| tokens | path | ms | ×split | peak MiB | ×split | output diff | grad diff |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['tokens']} | {r['path']} | {r['ms']} | {r.get('time_vs_split', '–')} | "
            f"{r['peak_extra_bytes'] / 2**20:.1f} | {r.get('peak_vs_split', '–')} | "
            f"{r['output_rel_diff']:.1e} | {r['grad_rel_diff']:.1e} |"
        )
    lines += [f"- absent: {p}: {why}" for p, why in absent.items()]
    return "\n".join(lines) + "\n"


def heading(rows: list[dict], where: str) -> str:
    s = rows[0]["shape"]
    return (
        f"{where}, {rows[0]['dtype']} · {s['experts']} experts top-{s['top_k']}, hidden "
        f"{s['hidden']}, moe_intermediate {s['intermediate']}, r {s['rank']}; median of "
        f"{rows[0]['repeats']}"
    )


def record(rows: list[dict], absent: dict[str, str], where: str, path: Path = RESULTS) -> None:
    """Append a dated block (heading line and table) at the end of this benchmark's section."""
    today = datetime.date.today().isoformat()
    block = f"- {today} · {heading(rows, where)}\n\n{table(rows, absent)}"
    bench_env.append_to_section(path, SECTION, ABOUT, block)


def where_label(device: torch.device) -> str:
    """The machine, and on a CPU a plain CPU label (a CPU figure is no GPU figure)."""
    return ("CPU: " if device.type == "cpu" else "") + machine(device)


# ---------------------------------------------------------------- entry


def run(shape: Shape, tokens: list[int], repeats: int, device: torch.device,
        dtype: torch.dtype) -> tuple[list[dict], dict[str, str]]:  # fmt: skip
    """Every available path at each token count; (rows with ratios, absent paths)."""
    absent = missing_paths()
    paths = [p for p in ("split", PEFT, "peft_unfolded", "peft_grouped_mm") if p not in absent]
    with warnings.catch_warnings():  # peft's FutureWarnings about renamed transformers APIs
        warnings.simplefilter("ignore")
        blocks = build(shape, paths, device, dtype)
        rows = [r for t in tokens for r in measure(blocks, t, shape, repeats, device, dtype)]
    return with_ratios(rows), absent


def disagreement(rows: list[dict], tolerance: float) -> list[str]:
    return [
        f"{r['path']} at {r['tokens']} tokens: output {r['output_rel_diff']:.1e}, grads "
        f"{r['grad_rel_diff']:.1e} (relative, > {tolerance:.0e})"
        for r in rows
        if max(r["output_rel_diff"], r["grad_rel_diff"]) > tolerance
    ]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="32 experts, hidden 512 (seconds)")
    ap.add_argument("--tokens", default=None,
                    help="token counts, comma list (default 4096,16384; --quick 1024)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per path")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["fp32", "bf16"],
                    help="default: bf16 on CUDA, fp32 on CPU")  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--record", action="store_true", help="append to results/engine.md")
    ap.add_argument("--smoke", action="store_true",
                    help="8 experts, hidden 64, fp32 on the CPU; fails unless every path "
                    f"agrees with peft's to {SMOKE_TOLERANCE:.0e}; no record")  # fmt: skip
    bench_env.add_argument(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.record, args.device, args.dtype, args.repeats = False, "cpu", "fp32", 1
    return args


def options(args: argparse.Namespace) -> tuple[Shape, list[int], torch.device, torch.dtype, int]:
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    shape = {"smoke": SMOKE, "quick": QUICK, "full": FULL}[size]
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(TOKENS[size])
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    ]
    return shape, tokens, device, dtype, args.repeats or (5 if device.type == "cuda" else 3)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    bench_env.apply()
    shape, tokens, device, dtype, repeats = options(args)
    rows, absent = run(shape, tokens, repeats, device, dtype)
    where = where_label(device)
    print(json.dumps({"rows": rows, "absent": absent}, indent=2) if args.json else
          f"{heading(rows, where)}\n\n{table(rows, absent)}")  # fmt: skip
    if args.smoke and (bad := disagreement(rows, SMOKE_TOLERANCE)):
        print("paths disagree: " + "; ".join(bad), file=sys.stderr)
        return 1
    if args.record:
        record(rows, absent, where)
    return 0


if __name__ == "__main__":
    sys.exit(main())
