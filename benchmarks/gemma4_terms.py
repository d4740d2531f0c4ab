"""gemma4_text's analytic activation terms against the trace, shape by shape.

Tiny width (hidden 64, 4 experts), LoRA r4 on moetune's default targets, `plan.fit.analytic`
vs `plan.trace.cache.cached_trace` (fused AdamW, steady state): the peak with gradient
checkpointing on and off, and "kept" = gc off − gc on (what the layers save for backward).
"raw" is the analytic with the generic GQA profile gemma4 had before its terms (the plan
traced instead). Prints a markdown table for benchmarks/results/census-and-terms.md.

    python benchmarks/gemma4_terms.py [--only NAME,NAME] [--smoke] [--threads N]
"""

from __future__ import annotations

import argparse
import time
from typing import Any
from unittest import mock

import bench_env

from moetune.config import parse_config
from moetune.model import spec_from_config
from moetune.model.census import shrunk_config
from moetune.model.spec import ModelSpec
from moetune.plan.fit import analytic
from moetune.plan.profiles import registry as profiles
from moetune.plan.trace.cache import cached_trace

SLIDING, FULL = "sliding_attention", "full_attention"
# Gemma-4-26B-A4B's heads at tiny width: 16 × 256 (8 kv heads) on sliding windows of 1024,
# every sixth layer full attention with k = v and 2 kv heads × 512
RELEASED = {
    "hidden_size_per_layer_input": 0,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "sliding_window": 1024,
    "attention_k_eq_v": True,
    "layer_types": [SLIDING] * 5 + [FULL],
    "num_hidden_layers": 6,
    "per_layer_config": {5: {"head_dim": 512, "num_key_value_heads": 2}},
}
TINY_26B = {"hidden_size_per_layer_input": 0, "attention_k_eq_v": True,
            "per_layer_config": {3: {"head_dim": 32, "num_key_value_heads": 1}}}  # fmt: skip
SHAPES: dict[str, tuple[int, dict[str, Any]]] = {
    "census shape (per-layer inputs 256; fit)": (128, {}),
    "seq 256 (fit)": (256, {}),
    "per-layer inputs 64 (fit)": (128, {"hidden_size_per_layer_input": 64}),
    "no per-layer inputs (fit)": (128, {"hidden_size_per_layer_input": 0}),
    "full layer k = v, 1 kv head × 32 (fit)": (128, TINY_26B),
    "8 heads, window 64 (held out)": (128, {**TINY_26B, "num_attention_heads": 8,
                                           "sliding_window": 64}),
    "26B-A4B heads, seq 2048 (fit: q-norm backward)": (2048, RELEASED),
    "26B-A4B layout, 8 heads, seq 2048 (fit)": (2048, {**RELEASED, "num_attention_heads": 8}),
    "26B-A4B heads, seq 1024 (held out)": (1024, RELEASED),
}  # fmt: skip


def tiny(over: dict[str, Any]) -> ModelSpec:
    return spec_from_config({**shrunk_config("gemma4_text"), **over}, "gemma4_text")


def row(name: str, seq: int, over: dict[str, Any]) -> str:
    spec, start = tiny(over), time.perf_counter()
    on, off = (parse_config({"lora": {"rank": 4}, "train": {"seq_len": seq,
               "gradient_checkpointing": gc}}) for gc in (True, False))  # fmt: skip
    est = {gc: analytic(spec, run).peak_bytes for gc, run in ((True, on), (False, off))}
    trace = {gc: cached_trace(spec, run).peak_bytes for gc, run in ((True, on), (False, off))}
    with mock.patch.dict(profiles.PROFILES, {"gemma4_text": profiles.DEFAULT}):
        raw = analytic(spec, off).peak_bytes - analytic(spec, on).peak_bytes
    kept = trace[False] - trace[True]
    cells = [raw / kept, est[True] / trace[True], est[False] / trace[False]]
    cells.append((est[False] - est[True]) / kept)
    pct = " | ".join(f"{100 * (c - 1):+.1f} %" for c in cells)
    mib = f"{trace[True] / 2**20:.1f} / {trace[False] / 2**20:.1f}"
    return f"| {name} | {seq} | {mib} | {pct} | {time.perf_counter() - start:.0f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated shape names (prefixes)")
    parser.add_argument("--smoke", action="store_true", help="the census shape only")
    bench_env.add_argument(parser)
    args = parser.parse_args()
    bench_env.apply()
    only = ["census shape"] if args.smoke else [s for s in args.only.split(",") if s]
    print("| shape | seq | trace peak gc on / off (MiB) | raw kept | peak gc on | peak gc off "
          "| kept | s |\n|---|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    for name, (seq, over) in SHAPES.items():
        if not only or any(name.startswith(o) for o in only):
            print(row(name, seq, over), flush=True)


if __name__ == "__main__":
    main()
