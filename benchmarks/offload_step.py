"""A disk-offloaded run through the CLI against its own plan: step time and peak RSS.

`moetune plan run.yaml --json` and `moetune train run.yaml` run in subprocesses, as a user
runs them, on --model (a safetensors MoE checkpoint; bf16 or a published FP8 / MXFP4 base)
with train.offload disk, fp32 compute on the CPU, LoRA r --rank on the experts, batch 1 ×
--seq tokens, checkpointing off. The train process's RSS (children included) is sampled
every 20 ms; the step times are the trainer's own (metrics.jsonl), the first step – the
page faults of first use, the optimizer's state – reported apart from the steady ones.
Side by side: planned vs measured step time (the plan of this host, `doctor --calibrate`'s
rates when stored) and planned vs measured peak RSS.

`--smoke`: a tiny bf16 checkpoint written to a temp dir, 2 steps, seconds (the suite runs
it; nothing recorded). `--record` appends to RESULTS.md.

    python benchmarks/offload_step.py --model DIR [--steps 3] [--seq 32] [--rank 4]
        [--threads N] [--smoke] [--record] [--json F]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import bench_env
import torch
from offload_disk import SMOKE, machine, write_checkpoint
from stored_offload import plan, train, write_run

GiB = 2**30
HEAD = "## offload_step: a disk-offloaded `moetune train` against its plan (step time, peak RSS)"


def step_times(run_dir: Path) -> list[float]:
    """Seconds per optimizer step from the trainer's metrics rows: tokens since the last row
    over its tokens/s, shared among the steps between the rows."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("tokens_per_s")]
    out, tokens, step = [], 0, 0
    for r in rows:
        seconds = (r["tokens"] - tokens) / r["tokens_per_s"]
        out += [seconds / max(1, r["step"] - step)] * max(1, r["step"] - step)
        tokens, step = r["tokens"], r["step"]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="offload-step-"))
    try:
        model = Path(args.model) if args.model else root / "base"
        if not args.model:
            write_checkpoint(model, {**SMOKE, "num_hidden_layers": 2}, progress=False)
        config = write_run(root, model, args)
        planned = plan(config)
        rc, peak, disk_read, seconds = train(config, root / "train.log")
        if rc != 0:
            log = (root / "train.log").read_text(errors="replace")
            raise SystemExit(f"moetune train failed (rc {rc}):\n{log[-3000:]}")
        steps = step_times(root / "run")
        if not steps:
            metrics = (root / "run" / "metrics.jsonl").read_text()
            raise SystemExit(f"no step times in metrics.jsonl:\n{metrics[-2000:]}")
        stats = json.loads((root / "run" / "offload.json").read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    steady = steps[1:] or steps
    return {"machine": machine(), "model": str(args.model or "smoke"), "steps": steps,
            "step_s": statistics.median(steady), "rss_peak": peak, "train_s": round(seconds, 1),
            "proc_read_bytes": disk_read, "offload": stats, "rank": args.rank, "seq": args.seq,
            "plan": planned}  # fmt: skip


def describe(r: dict[str, Any]) -> str:
    p, m = r["plan"], r["machine"]
    host = p["host_ram_bytes"] + (p.get("device_peak_bytes") or 0) * p.get("same_pool", 0)
    read = sum(r["offload"]["bytes_read"].values()) / len(r["steps"])
    lines = [
        f"- {m['date']} · {m['cpu']}, {m['cores']} cores, {m['ram_bytes'] / GiB:.1f} GiB RAM, "
        f"{m['threads']} · `{r['model']}` · train.offload disk, fp32, LoRA r {r['rank']} on "
        f"the experts, batch 1 × {r['seq']} tokens · steps (s): "
        + ", ".join(f"{s:.1f}" for s in r["steps"]),
        "",
        "| | plan | measured | measured / plan |",
        "|---|---|---|---|",
        f"| step time (steady) | {p['step_time_s']:.1f} s ({p.get('bound', '?')}-bound) | "
        f"{r['step_s']:.1f} s | {r['step_s'] / p['step_time_s']:.3f} |",
        f"| peak RSS | {host / GiB:.2f} GiB | {r['rss_peak'] / GiB:.2f} GiB | "
        f"{r['rss_peak'] / host:.3f} |",
        f"| bytes read per step | {sum(p['bytes_moved_per_step'].values()) / GiB:.2f} GiB | "
        f"{read / GiB:.2f} GiB | {read / sum(p['bytes_moved_per_step'].values()):.3f} |",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="the checkpoint dir (smoke: a tiny one is written)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="tiny bf16 model, 2 steps, no record")
    ap.add_argument("--record", action="store_true", help="append to benchmarks/RESULTS.md")
    ap.add_argument("--json", help="also write the figures to this file")
    bench_env.add_argument(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.steps, args.record = None, 2, False
    elif not args.model:
        ap.error("--model is required (or --smoke)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench_env.apply()
    torch.manual_seed(0)
    result = run(args)
    text = describe(result)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.record:
        bench_env.append_results(Path(__file__).with_name("RESULTS.md"), HEAD, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
