"""Planner vs real CUDA memory: does the trace's peak match `torch.cuda.max_memory_allocated`?

For each case (Qwen3-30B-A3B at full size, randomly initialised on the GPU, and OLMoE-1B-7B)
the planner's estimates – the fake-tensor trace of the step (`plan.trace.cache.cached_trace`,
steady state: 2 steps, fused AdamW, TRL's fused LM head) and the analytic formula
(`plan.fit.analytic`) – are set against the same step run for real: build, warm-up, measured
pass and tracker pass (gpu_cases.py says how, and how long each is expected to take).

error = predicted / measured − 1 (goal |error| ≤ 3 %). Also recorded: max_memory_reserved
and the memory outside PyTorch (CUDA context) against the planner's overhead terms
(`plan.overhead`), and the analytic's error.

The traces run in CPU worker processes (spawned, one thread each, CUDA hidden) while the
GPU measures, so their 20–60 s each overlap the GPU work. Cases start only while the
expected time fits `--budget-s` (a tracker pass only if max(tracker_s, 8 × step_s) fits; the
clock starts after the imports); the JSON is rewritten after every case.

The "moe-layer" case is benchmarks/moe_layer.py's whole table (one Qwen3-30B-A3B MoE layer,
bf16, 4k and 16k tokens: split LoRA, peft's ParamWrapper with and without its baddbmm fold,
transformers' grouped_mm under peft); it runs first (~60 s guessed on an H100, so a 420 s
budget leaves out one more of the tail cases) and is recorded on moe_layer's page
(results/engine.md, or `--results` when given).

`--smoke` runs tiny versions of every case on the CPU in seconds: the measured pass then
has no allocator to read, so measured_bytes is the tracker's count of the real-tensor step
(what `trace_step(..., fake=False)` counts), which must equal the prediction byte for byte.
TRL's CPU fold of the LM head makes fp32 copies that its CUDA kernels do not, so on the CPU
the folds are the trace's in-place stand-ins (`plan.trace.in_place_folds`).

A device run: `--out $OUT --budget-s 420` with a 540 s timeout; then, on this machine,
`--record-from <files_at>/gpu_validate.json` appends the summary to
results/trace-and-planner.md (the device's copy of the tree does not come back).

    python benchmarks/gpu_validate.py [--out DIR] [--budget-s 420] [--cases a,b]
        [--record [--results PATH]] [--jobs N] [--no-tracker] [--json] [--smoke]
    python benchmarks/gpu_validate.py --record-from gpu_validate.json [--results PATH]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import bench_env
import moe_layer
import torch

# A sibling: `python benchmarks/gpu_validate.py` puts benchmarks/ first on sys.path.
from gpu_cases import (
    CASES,
    Case,
    Predictions,
    build,
    build_seconds,
    free_memory,
    grouped,
    run_case,
    seq_for,
    spec_for,
    sync_device,
)

GiB = 2**30
GOAL = 0.03  # |predicted / measured − 1|
LAYER = "moe-layer"  # moe_layer.py's table, not a planner case
LAYER_EXPECT_S = 60.0  # H100 guess: build (~5 s), 2 token counts × 4 paths × 6 steps, warm-ups
RESULTS = bench_env.results_page("trace-and-planner")
SECTION = "## GPU validation: planner vs real CUDA memory (`benchmarks/gpu_validate.py`)"
ABOUT = (
    "`python benchmarks/gpu_validate.py`: the planner's trace (steady state, 2 steps, fused "
    "AdamW, TRL's fused LM head, batch 1, bf16, LoRA r=16 α=32 on attention + experts, "
    "explicit `target_parameters`) against the same step run on randomly initialised "
    "weights. measured = `torch.cuda.max_memory_allocated` over steps 1–2 minus what was "
    "allocated before the step besides the weights; error = predicted / measured − 1 (goal "
    "≤ 3 %); tracker = the trace's byte counting on the real CUDA step; reserved + context "
    "= `max_memory_reserved` + memory outside PyTorch, against the planner's required "
    "(peak + `plan.overhead`); step s = median of 3 steps after a warm-up."
)


# ---------------------------------------------------------------- the comparison


def compare(case: Case, seq: int, pred: dict[str, Any], meas: dict[str, Any]) -> dict[str, Any]:
    """One JSON row: both estimates, the measurements, and their relative errors."""
    measured = meas["measured_bytes"]
    row: dict[str, Any] = {"case": case.name, "status": "ok", **asdict(case), "seq_len": seq}
    row |= pred | meas
    row["error"] = _rel(pred["predicted_bytes"], measured)  # None: no plan for it here
    row["analytic_error"] = _rel(pred["analytic_bytes"], measured)
    row["within_goal"] = row["error"] is not None and abs(row["error"]) <= GOAL
    row["tokens_per_s"] = round(seq / meas["step_s"], 1)
    plan = pred.get("plan")
    planned_s = plan.get("step_time_s") if isinstance(plan, dict) else None
    if planned_s:  # an offload row: the plan's step time (stream vs compute) against the step
        row["planned_step_s"], row["step_error"] = planned_s, _rel(planned_s, meas["step_s"])
    if "tracker_bytes" in meas:
        row["tracker_error"] = pred["predicted_bytes"] / meas["tracker_bytes"] - 1
    if "max_reserved_bytes" in meas and pred.get("overhead_bytes") is not None:
        need = meas["max_reserved_bytes"] + meas["non_torch_bytes"]
        row["required_measured_bytes"] = need
        row["required_predicted_bytes"] = pred["predicted_bytes"] + pred["overhead_bytes"]
        row["required_error"] = row["required_predicted_bytes"] / need - 1
    return row


def _rel(predicted: float | None, measured: float) -> float | None:
    return None if predicted is None else predicted / measured - 1


# ---------------------------------------------------------------- the run


@dataclass
class Run:
    """Where the run stands: rows so far, the clock, where the JSON goes."""

    args: argparse.Namespace
    device: torch.device
    out: Path
    start: float
    rows: list[dict[str, Any]]
    layer: dict[str, Any] = field(default_factory=dict)  # the "moe-layer" table, if asked

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def fits(self, seconds: float) -> bool:
        """Whether work expected to take `seconds` on an H200 ends within the budget."""
        return self.elapsed + (0 if self.args.smoke else seconds) <= self.args.budget_s

    def wants_tracker(self, case: Case, step_s: float) -> bool:
        """Tracker pass: 2 steps, every op through Python (guessed ~4x an eager step)."""
        return not self.args.no_tracker and self.fits(max(case.tracker_s, 8 * step_s))

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        err = row["status"]
        if err == "ok":
            err = "plan: n/a" if row["error"] is None else f"error {100 * row['error']:+.2f} %"
        print(f"[{self.elapsed:6.1f} s] {row['case']}: {err} {row.get('reason', '')}".rstrip())
        write_json(self.out, report(self))


def run_group(run: Run, cases: list[Case], predictions: Predictions) -> None:
    """Build once, then each case that still fits the budget; failures are rows too."""
    model, build_error, build_s = None, "", 0.0
    for case in cases:
        seq = seq_for(case, run.args.smoke)
        need = case.expect_s + (build_seconds(case) if model is None and not build_error else 0)
        if build_error or not run.fits(need):
            reason = build_error or f"budget: {run.elapsed:.0f} s used, ~{need:.0f} s expected"
            run.add({"case": case.name, "status": "skipped", "reason": reason})
            continue
        try:
            if model is None:
                spec = spec_for(case, run.args.smoke)
                start = time.perf_counter()
                model = build(case, spec, run.device)
                sync_device(run.device)
                build_s = round(time.perf_counter() - start, 1)
            wants = functools.partial(run.wants_tracker, case)
            meas = run_case(model, case, seq, run.device, wants)
            row = compare(case, seq, predictions.get(case), {**meas, "build_s": build_s})
        except Exception as exc:  # OOM or a broken path: record it, go on with the rest
            row = {"case": case.name, "status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
            if model is None:
                build_error = f"build failed: {row['reason']}"
            del exc
            free_memory(run.device)
        run.add(row)
    del model
    free_memory(run.device)


def run_layer(run: Run) -> None:
    """moe_layer.py's table (smoke: its tiny fp32 shape on the CPU), if the budget allows."""
    if not run.fits(LAYER_EXPECT_S):
        run.layer = {"status": "skipped", "reason": f"budget: {run.elapsed:.0f} s used"}
    else:
        size = "smoke" if run.args.smoke else "full"
        shape = moe_layer.SMOKE if run.args.smoke else moe_layer.FULL
        dtype = torch.float32 if run.args.smoke else torch.bfloat16
        repeats = 1 if run.args.smoke else 5
        try:
            rows, absent = moe_layer.run(shape, list(moe_layer.TOKENS[size]), repeats,
                                         run.device, dtype)  # fmt: skip
            run.layer = {"status": "ok", "rows": rows, "absent": absent}
        except Exception as exc:  # OOM or a broken path: record it, go on with the cases
            run.layer = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
            del exc
        free_memory(run.device)
    print(f"[{run.elapsed:6.1f} s] {LAYER}: {run.layer['status']} {run.layer.get('reason', '')}")
    write_json(run.out, report(run))


def record_layer(data: dict[str, Any], results: Path | None) -> Path | None:
    """The layer table on moe_layer's page (or `results`); None when it did not run."""
    layer = data.get("layer_table") or {}
    if layer.get("status") != "ok":
        return None
    where = f"{data['machine']['device']} (gpu_validate)"
    path = results or moe_layer.RESULTS
    moe_layer.record(layer["rows"], layer["absent"], where, path)
    return path


def machine(device: torch.device) -> dict[str, Any]:
    from transformers.utils import is_triton_available

    names = ("torch", "transformers", "peft", "trl")
    info: dict[str, Any] = {n: metadata.version(n) for n in names}
    info |= {"host": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores",
             "date": datetime.date.today().isoformat(),
             "triton": is_triton_available(), "threads": bench_env.describe()}  # fmt: skip
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        info |= {"device": torch.cuda.get_device_name(device), "cuda": torch.version.cuda,
                 "device_memory_gib": round(total / GiB, 1),
                 "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}  # fmt: skip
    else:
        info["device"] = "cpu"
    return info


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if r["status"] == "ok"]
    planned = [r for r in ok if r["error"] is not None]  # an offload row may have no plan
    out: dict[str, Any] = {"cases": len(rows), "ok": len(ok), "goal": GOAL,
                           "within_goal": sum(r["within_goal"] for r in ok)}  # fmt: skip
    if planned:
        worst = max(planned, key=lambda r: abs(r["error"]))
        out |= {"worst_error": worst["error"], "worst_case": worst["case"],
                "mean_abs_error": statistics.fmean(abs(r["error"]) for r in planned)}  # fmt: skip
    return out


def report(run: Run) -> dict[str, Any]:
    return {"smoke": run.args.smoke, "wall_s": round(run.elapsed, 1),
            "budget_s": run.args.budget_s, "machine": machine(run.device),
            "summary": summary(run.rows), "cases": run.rows,
            "layer_table": run.layer}  # fmt: skip


def write_json(out: Path, data: dict[str, Any]) -> Path:
    """Atomically (temp file + rename), so a run killed mid-case leaves the cases before it."""
    return _write(out / "gpu_validate.json", json.dumps(data, indent=2, default=str) + "\n")


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


# ---------------------------------------------------------------- results page


def table(rows: list[dict[str, Any]], smoke: bool = False) -> str:
    unit, size = ("MiB", 2**20) if smoke else ("GiB", GiB)

    def mem(n: float | None) -> str:
        return "–" if n is None else f"{n / size:.2f}"

    def pct(x: float | None) -> str:
        return "–" if x is None else f"{100 * x:+.1f} %"

    lines = [f"| case | predicted {unit} | measured {unit} | error | tracker {unit} | analytic "
             f"error | reserved + context {unit} | planner required {unit} | step s |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['case']} | {r['status']}: {r.get('reason', '')} | | | | | | | |")
            continue
        lines.append(
            f"| {r['case']} | {mem(r['predicted_bytes'])} | {mem(r['measured_bytes'])} | "
            f"{pct(r['error'])} | {mem(r.get('tracker_bytes'))} | {pct(r['analytic_error'])} | "
            f"{mem(r.get('required_measured_bytes'))} | {mem(r.get('required_predicted_bytes'))} "
            f"| {r['step_s']}{_planned_step(r)} |"
        )
    return "\n".join(lines) + "\n"


def _planned_step(row: dict[str, Any]) -> str:
    """An offload row's step time beside the plan's (the stream at the host link's rate)."""
    if row.get("planned_step_s") is None:
        return ""
    return f" (planned {row['planned_step_s']:.3g}, {100 * row['step_error']:+.0f} %)"


def markdown(data: dict[str, Any]) -> str:
    """A dated line and the case table: what goes under this benchmark's section."""
    m, s = data["machine"], data["summary"]
    cuda = f" (CUDA {m['cuda']})" if m.get("cuda") else ""
    where = (f"{m['device']} · torch {m['torch']}{cuda}, transformers {m['transformers']}, "
             f"peft {m['peft']}, trl {m['trl']}")  # fmt: skip
    worst = (f", worst error {100 * s['worst_error']:+.2f} % ({s['worst_case']}), mean |error| "
             f"{100 * s['mean_abs_error']:.2f} %" if "worst_error" in s else "")  # fmt: skip
    smoke = " · --smoke (tiny models)" if data["smoke"] else ""
    line = (f"- {m['date']} · {where}{smoke} · {s['ok']}/{s['cases']} cases ran{worst}, "
            f"{s['within_goal']}/{s['ok']} within {100 * GOAL:.0f} %; "
            f"{data['wall_s']} s wall")  # fmt: skip
    return f"{line}\n\n{table(data['cases'], data['smoke'])}"


def record(path: Path, data: dict[str, Any]) -> None:
    """Append the run's block at the end of this benchmark's section (made if missing)."""
    bench_env.append_to_section(path, SECTION, ABOUT, markdown(data))


# ---------------------------------------------------------------- entry


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    names = [LAYER, *(c.name for c in CASES)]
    default = ",".join([LAYER, *(c.name for c in CASES if c.default)])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cases", default=default, help=f"comma list of: {', '.join(names)} (default: {default})"
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="start no case expected to end after this many seconds (default 420)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="gpu_validate.json and .md go here (default $OUT or ./gpu_validate_out)",
    )
    bench_env.add_argument(ap)
    ap.add_argument(
        "--results",
        type=Path,
        default=None,
        help="where --record and --record-from append (default results/trace-and-planner.md)",
    )
    ap.add_argument("--record", action="store_true", help="append the summary to --results")
    ap.add_argument(
        "--record-from",
        type=Path,
        default=None,
        metavar="JSON",
        help="append a finished run's gpu_validate.json to --results, run nothing "
        "(the device machine's copy of the results page does not come back)",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="trace worker processes (default: cores − 2; --smoke: 0 = inline)",
    )
    ap.add_argument(
        "--no-tracker", action="store_true", help="skip the ByteTracker pass on the real CUDA step"
    )
    ap.add_argument("--json", action="store_true", help="print the whole JSON at the end")
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU (seconds)")
    args = ap.parse_args(argv)
    unknown = set(args.cases.split(",")) - set(names)
    if unknown:
        ap.error(f"unknown case(s) {', '.join(sorted(unknown))}; choose from {', '.join(names)}")
    return args


def record_from(args: argparse.Namespace) -> int:
    data = json.loads(args.record_from.read_text())
    layer = record_layer(data, args.results)
    if layer:
        print(f"appended the {LAYER} table to {layer}")
    if not data["summary"]["ok"]:
        print(f"gpu_validate: {args.record_from} has no finished case; nothing recorded.")
        return 0 if layer else 1
    results = args.results or RESULTS
    record(results, data)
    print(f"appended {data['summary']['ok']} case(s) to {results}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench_env.apply()
    if args.record_from is not None:
        return record_from(args)
    start = time.perf_counter()
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_validate: CUDA is not available here; run it on a GPU machine, or pass --smoke "
              "for the CPU check.", file=sys.stderr)  # fmt: skip
        return 2
    device = torch.device("cpu" if args.smoke else "cuda")
    out = args.out or Path(os.environ.get("OUT") or "gpu_validate_out")
    wanted = args.cases.split(",")
    cases = [c for c in CASES if c.name in wanted]
    cores = os.cpu_count() or 1
    jobs = args.jobs if args.jobs is not None else (0 if args.smoke else max(1, cores - 2))
    run = Run(args, device, out, start, [])
    threads = torch.get_num_threads()
    if args.smoke:
        torch.set_num_threads(1)  # tiny steps: threads only contend on a shared machine
    predictions = Predictions(cases, args.smoke, jobs)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # peft calls renamed transformers APIs
            if LAYER in wanted:
                run_layer(run)
            for group in grouped(cases):
                run_group(run, group, predictions)
    finally:
        predictions.close()
        torch.set_num_threads(threads)
    return finish(run)


def finish(run: Run) -> int:
    """Final JSON and markdown under --out; the summary appended to the results file."""
    args, data = run.args, report(run)
    path = write_json(run.out, data)
    _write(run.out / "gpu_validate.md", markdown(data))
    results = (args.results or RESULTS) if data["summary"]["ok"] else None  # none finished
    if args.record and results is not None:
        record(results, data)
    if args.record:
        record_layer(data, args.results)
    print(json.dumps(data, indent=2, default=str) if args.json else markdown(data))
    if run.layer.get("status") == "ok":
        print(moe_layer.table(run.layer["rows"], run.layer["absent"]))
    print(f"wrote {path}" + (f"; appended to {results}" if args.record and results else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
