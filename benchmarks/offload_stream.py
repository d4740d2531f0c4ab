"""The offload stream against the machine's own rates, side by side in one run.

disk: the file system's sequential O_DIRECT read rate over the checkpoint's own files
(`engine.direct_io.read_rate`, one 16 MiB read in flight as `dd iflag=direct` does, and
DEPTH in flight; the better of the two is the reference) against the rate at which an
`ExpertStore` (train.offload: disk) hands over the expert stacks of every layer – up the
layers and down again, as a step's forward and backward fetch them, widened to --dtype on
the way, with no compute in between (so the stream alone is timed). Rounds alternate
reference and stream (--rounds), so a neighbour's load hits both alike.

cpu: a large memcpy (the same bytes as one layer's stacks) against the stream of a
train.offload: cpu store (the stacks held in host RAM in the stored dtype, copied – and
widened – into each fetch), over the first --cpu-layers layers.

The checkpoint: --model DIR (a bf16 safetensors checkpoint of a fused-experts MoE), or a
random-weight one of the Qwen3-30B-A3B shape with --layers layers written under --out
(benchmarks/offload_disk.py's writer; deleted at the end unless --keep).
`--smoke`: a tiny shape, one round, seconds (the suite runs it; nothing recorded).
`--record` appends to results/offload-and-stored.md.

    python benchmarks/offload_stream.py [--model DIR | --layers 4 --out DIR] [--dtype float32]
        [--rounds 2] [--cpu-layers 2] [--threads N] [--keep] [--smoke] [--record] [--json F]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_env
import torch

GB = 1e9


def disk_reference(files: list[str], budget: int) -> dict[str, Any]:
    from moetune.engine.direct_io import CHUNK, DEPTH, read_rate

    one = read_rate(files, budget, depth=1, chunk=16 << 20)
    many = read_rate(files, budget, depth=DEPTH, chunk=CHUNK)
    best = max(one, many, key=lambda r: r.bytes_per_s)
    return {"one_in_flight": one.bytes_per_s, "depth": many.bytes_per_s,
            "bytes_per_s": best.bytes_per_s, "direct": best.direct}  # fmt: skip


def stream_pass(store: Any, layers: int) -> dict[str, Any]:
    """Every layer up, then down (a step's forward and backward order); the stream's rate
    (bytes read from the files; for a cpu store, bytes copied out of host RAM)."""
    read0, moved0 = sum(store.stats.bytes_read.values()), sum(store.stats.bytes_moved.values())
    start = time.perf_counter()
    for i, layer in enumerate([*range(layers), *range(layers - 1, -1, -1)]):
        store.fetch(layer, next(iter(store.layers[layer])), backward=i >= layers)
    store.wait_prefetch()
    seconds = time.perf_counter() - start
    read = sum(store.stats.bytes_read.values()) - read0
    nbytes = read or sum(store.stats.bytes_moved.values()) - moved0
    return {"bytes": nbytes, "seconds": seconds, "bytes_per_s": nbytes / seconds}


def memcpy_rate(nbytes: int) -> float:
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    dst.copy_(src)  # pages touched before the timing
    start = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    return 3 * nbytes / (time.perf_counter() - start)


def cpu_store(disk: Any, layers: int, dtype: torch.dtype) -> Any:
    """A train.offload: cpu store of the first `layers` layers of a disk store's stacks."""
    from moetune.engine.offload.sources import host_source
    from moetune.engine.offload.store import ExpertStore

    store = ExpertStore("cpu", "cpu")
    for sources in disk.layers[:layers]:
        held = {}
        for name, (source, _) in sources.items():
            weight, pieces = source.prepare(torch.device("cpu"), source.segments[0].dtype)
            disk.reader.read(pieces)
            held[name] = (host_source(weight, pin=False), dtype)
        store.add_layer(held)
    return store


def checkpoint(args: argparse.Namespace) -> tuple[Path, bool]:
    """The model dir, and whether this run wrote it (and so deletes it)."""
    if args.model:
        return Path(args.model), False
    import offload_disk

    cfg = {**(offload_disk.SMOKE if args.smoke else offload_disk.QWEN3_30B),
           "num_hidden_layers": args.layers}  # fmt: skip
    out = Path(args.out or tempfile.mkdtemp(prefix="moetune-stream-"))
    if not offload_disk.reused(out, cfg):
        offload_disk.write_checkpoint(out, cfg, progress=not args.smoke)
    return out, not args.keep


def measure(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from moetune.engine.offload.load import load_offloaded

    dtype = getattr(torch, args.dtype)
    files = sorted(str(p) for p in model_dir.glob("*.safetensors"))
    model, disk, _ = load_offloaded(model_dir, "disk", "cpu", dtype)
    layers, budget = len(disk.layers), min(disk.stats.stored_bytes, 4 << 30)
    rounds: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        rounds.append({"reference": disk_reference(files, budget),
                       "stream": stream_pass(disk, layers)})  # fmt: skip
    disk.release()  # its host buffers go before the cpu store takes its own
    cpu = cpu_store(disk, min(args.cpu_layers, layers), dtype)
    cpu_rounds = [
        {"memcpy": memcpy_rate(cpu.stats.layer_bytes), "stream": stream_pass(cpu, len(cpu.layers))}
        for _ in range(args.rounds)
    ]
    del model
    return {"layers": layers, "dtype": args.dtype, "stored_bytes": disk.stats.stored_bytes,
            "disk": rounds, "cpu": cpu_rounds}  # fmt: skip


def summarize(r: dict[str, Any]) -> dict[str, float]:
    disk = [x["stream"]["bytes_per_s"] / x["reference"]["bytes_per_s"] for x in r["disk"]]
    cpu = [x["stream"]["bytes_per_s"] / x["memcpy"] for x in r["cpu"]]
    return {"disk_ratio": statistics.median(disk), "cpu_ratio": statistics.median(cpu)}


def describe(r: dict[str, Any]) -> str:
    s, m = summarize(r), r["machine"]
    lines = [
        f"- {m['date']} · {m['cpu']} · {m['cores']} cores · {bench_env.describe()} · "
        f"{r['layers']} layers, {r['stored_bytes'] / GB:.1f} GB of expert stacks, widened to "
        f"{r['dtype']}; median of {len(r['disk'])} interleaved rounds",
        "",
        "| round | O_DIRECT 1 in flight | O_DIRECT depth | disk stream | stream / reference |"
        " memcpy | cpu stream | stream / memcpy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, (d, c) in enumerate(zip(r["disk"], r["cpu"], strict=True)):
        ref, st = d["reference"], d["stream"]
        lines.append(
            f"| {i + 1} | {ref['one_in_flight'] / GB:.2f} GB/s | {ref['depth'] / GB:.2f} GB/s | "
            f"{st['bytes_per_s'] / GB:.2f} GB/s | {st['bytes_per_s'] / ref['bytes_per_s']:.2f} | "
            f"{c['memcpy'] / GB:.2f} GB/s | {c['stream']['bytes_per_s'] / GB:.2f} GB/s | "
            f"{c['stream']['bytes_per_s'] / c['memcpy']:.2f} |"
        )
    lines.append(f"\ndisk stream / O_DIRECT: {s['disk_ratio']:.2f} · "
                 f"cpu stream / memcpy: {s['cpu_ratio']:.2f}")  # fmt: skip
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a bf16 safetensors MoE checkpoint dir (else one is written)")
    ap.add_argument("--layers", type=int, default=4, help="layers of the written checkpoint")
    ap.add_argument("--out", help="where to write it (default: a temp dir)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (median)")
    ap.add_argument("--cpu-layers", type=int, default=2, help="layers the cpu store holds")
    ap.add_argument("--keep", action="store_true", help="keep a checkpoint this run wrote")
    ap.add_argument("--smoke", action="store_true", help="tiny shape, one round, no record")
    ap.add_argument("--record", action="store_true", help="append to results/offload-and-stored.md")
    ap.add_argument("--json", help="also write the figures to this file")
    bench_env.add_argument(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.rounds, args.record = 2, 1, False
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench_env.apply()
    from offload_disk import machine

    model_dir, owned = checkpoint(args)
    try:
        result = {"machine": machine(), **measure(model_dir, args)}
    finally:
        if owned:
            shutil.rmtree(model_dir, ignore_errors=True)
    text = describe(result)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.record:
        head = "## The offload stream against the machine's rates"
        bench_env.append_results(bench_env.results_page("offload-and-stored"), head, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
