"""A block-FP8 base larger than this machine's RAM as bf16, trained through the CLI with its
expert stacks read from the base's own files each step (`train.offload: disk`).

The checkpoint (benchmarks/fp8_checkpoint.py) is the Qwen3-30B-A3B shape with --layers
decoder layers (27 by default, as offload_disk.py's bf16 run: 34.9 GB as bf16 > 24 GiB of
RAM; 48 is the real model), random weights written directly as block FP8 (128x128 scales),
tensor by tensor – never a float model, never a bf16 copy – under --out, outside the git tree
(reused when complete with --reuse; deleted at the end unless --keep). Then, as a user would:
a run.yaml (LoRA r --rank on the experts, fp32 compute on the CPU, batch 1 × --seq tokens,
checkpointing off, --steps steps), `moetune plan run.yaml --json` and `moetune train
run.yaml` in subprocesses, the train process's RSS sampled with psutil every 20 ms. Side by
side: peak RSS (plan's host RAM vs measured), bytes read per step (plan's bytes moved vs the
run's offload.json), and bytes read per step against the bf16 run of the same shape – the
offload_disk figure on results/offload-and-stored.md when one of this layer count is recorded,
else 2× the FP8 expert bytes minus their scales (what bf16 stores).

`--smoke`: a tiny shape (32x32 blocks), one step, seconds (the test suite runs it; nothing
recorded). `--record` appends to the same page.

    python benchmarks/stored_offload.py [--layers 27] [--steps 2] [--seq 32] [--rank 4]
        [--threads N] [--out /work/bench-data/qwen3-30b-a3b-fp8] [--reuse] [--keep]
        [--smoke] [--record] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import bench_env
import psutil
import torch

# Siblings: `python benchmarks/stored_offload.py` puts benchmarks/ first on sys.path.
from fp8_checkpoint import reused, write_fp8_checkpoint
from offload_disk import KEEP_FREE, QWEN3_30B, SMOKE, machine

GiB = 2**30
SRC = Path(__file__).resolve().parents[1] / "src"
RESULTS = bench_env.results_page("offload-and-stored")
HEAD = (
    "## stored_offload: a block-FP8 base larger than RAM (as bf16), `moetune train`, disk offload"
)
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]


def shape(args: argparse.Namespace) -> tuple[dict[str, Any], tuple[int, int]]:
    base = SMOKE if args.smoke else QWEN3_30B
    return {**base, "num_hidden_layers": args.layers}, ((32, 32) if args.smoke else (128, 128))


def write_run(root: Path, model: Path, args: argparse.Namespace) -> Path:
    """run.yaml (and its data): disk offload, LoRA on the experts, fp32 on the CPU."""
    from moetune.config import dump_config, parse_config

    data = root / "train.jsonl"
    rows = [{"prompt": f"rev:{w}>", "completion": w[::-1]} for w in WORDS * 4]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    cfg = parse_config({
        "model": {"id": str(model), "dtype": "float32"},
        "lora": {"rank": args.rank, "targets": ["experts"], "engine": "moetune"},
        "data": {"train_file": str(data)},
        "output": {"dir": str(root / "run"), "ledger": str(root / "ledger.jsonl")},
        "train": {"offload": "disk", "max_steps": args.steps, "seq_len": args.seq,
                  "batch_size": 1, "device": "cpu", "precision": "fp32",
                  "gradient_checkpointing": False, "save_steps": 1000, "learning_rate": 1e-4,
                  # the base's routing forward reads the base once more: not a step's bytes
                  "routing_every": 0},
    })  # fmt: skip
    path = root / "run.yaml"
    path.write_text(dump_config(cfg), encoding="utf-8")
    return path


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}


def plan(config: Path) -> dict[str, Any]:
    """`moetune plan run.yaml --json`'s offload plan (the one for train.device cpu)."""
    cmd = [sys.executable, "-m", "moetune", "plan", str(config), "--json"]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"moetune plan failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)["offload"]["cpu"]


class Peak(threading.Thread):
    """The peak RSS of `pid` and its descendants, sampled every 20 ms; and the bytes the
    kernel read from storage for it (/proc/PID/io read_bytes: the store's preads plus the
    readahead they trigger, the load's reads included), last seen before it exits."""

    def __init__(self, pid: int, every: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.root, self.every, self.peak, self.disk_read = psutil.Process(pid), every, 0, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
                rss = sum(p.memory_info().rss for p in procs)
                self.disk_read = max(self.disk_read, self.root.io_counters().read_bytes)
            except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
                rss = 0
            self.peak = max(self.peak, rss)
            self.done.wait(self.every)


def train(config: Path, log: Path) -> tuple[int, int, int, float]:
    """`moetune train run.yaml`: exit code, peak RSS, disk bytes read, seconds (log: output)."""
    cmd = [sys.executable, "-m", "moetune", "train", str(config)]
    started = time.perf_counter()
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, env=_env(), stdout=sink, stderr=subprocess.STDOUT)
        sampler = Peak(proc.pid)
        sampler.start()
        rc = proc.wait()
    sampler.done.set()
    sampler.join()
    return rc, sampler.peak, sampler.disk_read, time.perf_counter() - started


def bf16_recorded(layers: int) -> float | None:
    """Bytes read per step by offload_disk.py's bf16 run of this layer count (its results page:
    the steady-state mean of its recorded steps after the first), or None."""
    if not RESULTS.exists():
        return None
    text = RESULTS.read_text(encoding="utf-8")
    found: list[float] = []
    for block in re.split(r"\n(?=- \d{4}-\d\d-\d\d )", text):
        if (
            f"Qwen3-30B-A3B shape with {layers} layers" not in block
            or "bf16 safetensors" not in block
        ):
            continue
        rows = re.findall(r"^\| (\d+) \| [\d.]+ \| ([\d.]+) \|", block, re.M)
        steady = [float(g) for s, g in rows if int(s) > 1] or [float(g) for _, g in rows]
        found = steady or found
    return sum(found) / len(found) * GiB if found else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg, block = shape(args)
    out = Path(args.out)
    have = reused(out, cfg, block) if args.reuse else 0
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    # FP8: ~0.62 GB a full-shape layer, 1.25 GB of bf16 embeddings and head
    need = 0 if have or args.smoke else int(cfg["num_hidden_layers"] * 0.62e9 + 1.3e9)
    if not args.smoke and free - need < KEEP_FREE:
        raise SystemExit(
            f"stored_offload: needs {need / 1e9:.1f} GB and keeps "
            f"{KEEP_FREE / 1e9:.0f} GB free; {free / 1e9:.1f} GB are free"
        )
    say = (lambda s: None) if args.smoke else (lambda s: print(s, flush=True))
    scratch = Path(tempfile.mkdtemp(prefix="stored-offload-", dir=out.parent))
    try:
        if have:
            written = {"bytes": have, "write_s": 0.0, "params_per_s": None, "reused": True}
        else:
            say(f"writing the FP8 checkpoint ({cfg['num_hidden_layers']} layers) to {out}")
            written = write_fp8_checkpoint(out, cfg, block=block, progress=say) | {"reused": False}
        config = write_run(scratch, out, args)
        planned = plan(config)
        say(
            f"plan: host RAM {planned['host_ram_bytes'] / GiB:.2f} GiB, bytes moved/step "
            f"{sum(planned['bytes_moved_per_step'].values()) / GiB:.2f} GiB; training…"
        )
        rc, peak, disk_read, seconds = train(config, scratch / "train.log")
        log = (scratch / "train.log").read_text(errors="replace")
        offload_json = scratch / "run" / "offload.json"
        if rc != 0 or not offload_json.exists():
            raise SystemExit(f"moetune train failed (rc {rc}):\n{log[-3000:]}")
        stats = json.loads(offload_json.read_text())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    read_step = sum(stats["bytes_read"].values()) / args.steps
    moved_plan = sum(planned["bytes_moved_per_step"].values())
    bf16 = bf16_recorded(cfg["num_hidden_layers"]) if not args.smoke else None
    bf16_from = "results/offload-and-stored.md (offload_disk.py, bf16, same shape)"
    if bf16 is None:  # what bf16 stores for the same experts: 2 bytes a param, no scales
        params = stats["stored_bytes"] / (1 + 4 / (block[0] * block[1]))
        bf16, bf16_from = 2 * params * read_step / stats["stored_bytes"], "2 × the FP8 params"
    return {
        "machine": machine(), "shape": {k: cfg[k] for k in ("num_hidden_layers", "num_experts",
                                        "hidden_size", "moe_intermediate_size", "vocab_size")},
        "block": list(block), "checkpoint": written, "rank": args.rank, "seq": args.seq,
        "steps": args.steps, "train_s": round(seconds, 1), "rss_peak": peak,
        "proc_read_bytes": disk_read,
        "plan": {k: planned[k] for k in ("host_ram_bytes", "device_peak_bytes",
                                          "bytes_moved_per_step", "disk_bytes", "transfer_s")},
        "offload": stats, "bytes_read_per_step": read_step, "plan_bytes_per_step": moved_plan,
        "bf16_bytes_read_per_step": bf16, "bf16_from": bf16_from, "kept": args.keep,
    }  # fmt: skip


def describe(r: dict[str, Any]) -> str:
    m, s, c, p = r["machine"], r["shape"], r["checkpoint"], r["plan"]
    g = lambda n: f"{n / GiB:.2f} GiB" if n >= GiB / 4 else f"{n / 2**20:.2f} MiB"  # noqa: E731
    rate = (
        "reused"
        if c["reused"]
        else (
            f"written in {c['write_s']} s ({c['params_per_s'] / 1e6:.3g} M params/s, "
            f"{c['bytes'] / max(c['write_s'], 1e-3) / 1e6:.3g} MB/s)"
        )
    )
    host = p["host_ram_bytes"]
    read, planned, bf16 = (
        r["bytes_read_per_step"],
        r["plan_bytes_per_step"],
        r["bf16_bytes_read_per_step"],
    )
    lines = [
        f"- {m['date']} · {m['cpu']}, {m['cores']} cores, {g(m['ram_bytes'])} RAM, torch "
        f"{m['torch']}, {m['threads']} · Qwen3-30B-A3B shape with {s['num_hidden_layers']} "
        f"layers ({s['num_experts']} experts × hidden {s['hidden_size']} × "
        f"{s['moe_intermediate_size']}) as **block FP8** ({r['block'][0]}x{r['block'][1]} "
        f"scales): **{c['bytes'] / 1e9:.1f} GB** ({g(r['offload']['stored_bytes'])} of expert "
        f"stacks, {g(r['offload']['layer_bytes'])} a layer), {rate}; `moetune train` "
        f"(train.offload disk, fp32 compute, LoRA r {r['rank']} on the experts, batch 1 × "
        f"{r['seq']} tokens, checkpointing off), {r['steps']} steps in {r['train_s']} s "
        f"(load included).",
        "",
        "| | plan (`moetune plan --json`) | measured | measured / plan |",
        "|---|---|---|---|",
        f"| peak RSS of `moetune train` | {g(host)} (host RAM) | {g(r['rss_peak'])} | "
        f"{r['rss_peak'] / host:.3f} |",
        f"| bytes read per step | {g(planned)} | {g(read)} | {read / planned:.3f} |",
        "",
        f"- bytes read per step, FP8 / bf16: {g(read)} / {g(bf16)} = **{read / bf16:.3f}** "
        f"(bf16: {r['bf16_from']}); by phase (whole run): "
        + ", ".join(f"{k} {g(v)}" for k, v in r["offload"]["bytes_read"].items()),
        f"- the kernel's reads for the train process (/proc/PID/io read_bytes, load and "
        f"readahead included): {g(r['proc_read_bytes'])} over the run, "
        f"{r['proc_read_bytes'] / max(1, sum(r['offload']['bytes_read'].values())):.2f}× the "
        f"store's count; the store's layer fetches: {r['offload']['fetches']} over "
        f"{r['steps']} steps of {r['offload']['layers']} layers (≈ 2 × layers a step expected).",
    ]  # fmt: skip
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 27; smoke 2)")
    ap.add_argument("--steps", type=int, default=None, help="steps (default 2; smoke 1)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--rank", type=int, default=4)
    bench_env.add_argument(ap)
    ap.add_argument("--out", default=None, help="the checkpoint's directory (default "
                    "/work/bench-data/qwen3-30b-a3b-fp8-<layers>; smoke: a temp dir)")  # fmt: skip
    ap.add_argument(
        "--reuse", action="store_true", help="use a complete checkpoint of this shape in --out"
    )
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint")
    ap.add_argument("--smoke", action="store_true", help="tiny shape, 1 step, nothing recorded")
    ap.add_argument("--record", action="store_true", help="append to results/offload-and-stored.md")
    ap.add_argument("--json", help="write the results JSON here")
    args = ap.parse_args(argv)
    args.layers = args.layers or (2 if args.smoke else 27)
    args.steps = args.steps or (1 if args.smoke else 2)
    if args.out is None:
        root = Path(tempfile.gettempdir()) if args.smoke else Path("/work/bench-data")
        name = (
            f"moetune-fp8-smoke-{os.getpid()}" if args.smoke else f"qwen3-30b-a3b-fp8-{args.layers}"
        )
        args.out = str(root / name)
    if args.smoke:
        args.record = False
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
        bench_env.append_results(RESULTS, HEAD, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
