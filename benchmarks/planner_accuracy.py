"""How close is the instant analytic estimate to the fake-tensor trace of the real step?

Runs the grid models × LoRA ranks {8, 16, 64} × sequence lengths {512, 2048, 8192} ×
gradient checkpointing {on, off} (moetune's default targets, explicit expert mapping),
plus the vanilla-peft acceptance case, with both estimators. `--flagships` runs the
newest families instead (hybrid linear attention, MLA with an indexer, …) at r=16 ×
seq {2048, 8192} × gc on/off; a flagship whose mixer kind has no calibrated analytic term
is planned with the trace (`plan.fit`), and its raw analytic error is shown apart.
Traces are cached on disk (`~/.cache/moetune/traces`), so a rerun only pays for what
changed. Prints the worst relative error and its case; `--record` appends a dated line
to benchmarks/results/trace-and-planner.md.

    python benchmarks/planner_accuracy.py [--quick | --flagships] [--json] [--models a,b]
        [--seqs 2048,8192] [--record]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any

import bench_env

from moetune.config import RunConfig, parse_config
from moetune.demo.base import SHIPPED_DIR
from moetune.model import load_spec
from moetune.plan.fit import analytic
from moetune.plan.profiles.registry import uncalibrated
from moetune.plan.trace.cache import cached_trace

RESULTS = bench_env.results_page("trace-and-planner")
SECTION = "## Planner accuracy: analytic vs trace"
ABOUT = (
    "`python benchmarks/planner_accuracy.py`: relative error of `plan.analytic` against "
    "`plan.trace` (steady-state step, fused AdamW) over models × ranks {8, 16, 64} × "
    "seq {512, 2048, 8192} × gradient checkpointing on/off, moetune's default targets; "
    "the full grid adds the vanilla-peft Qwen3-30B-A3B acceptance case."
)
GiB = 1024**3
MODELS = (
    "Qwen/Qwen3-30B-A3B",
    "Qwen/Qwen3-235B-A22B",
    "allenai/OLMoE-1B-7B-0924",
    "deepseek-ai/DeepSeek-V2-Lite",
    "mistralai/Mixtral-8x7B-v0.1",
    "openai/gpt-oss-20b",
)
QUICK_MODELS = ("allenai/OLMoE-1B-7B-0924", "deepseek-ai/DeepSeek-V2-Lite", "openai/gpt-oss-20b")
FLAGSHIPS = (
    "Qwen/Qwen3.5-35B-A3B",
    "google/gemma-4-26B-A4B-it",
    "zai-org/GLM-4.7-Flash",
    "deepseek-ai/DeepSeek-V3.2",
    "MiniMaxAI/MiniMax-M2",
    "Qwen/Qwen3-Next-80B-A3B-Instruct",
)
RANKS, SEQS, GCS = (8, 16, 64), (512, 2048, 8192), (True, False)
GRIDS = {  # name: (ranks, seqs)
    "full": (RANKS, SEQS),
    "quick": ((16,), (512, 2048)),
    "flagships": ((16,), (2048, 8192)),
    "smoke": ((8,), (64,)),  # the shipped demo base: the script still runs, in seconds
}


@dataclass(frozen=True)
class Case:
    model: str
    rank: int
    seq_len: int
    gc: bool
    mapping: str = "explicit"
    targets: tuple[str, ...] = ("attention", "experts", "dense", "shared")

    def config(self) -> RunConfig:
        return parse_config(
            {
                "model": {"id": self.model},
                "lora": {
                    "rank": self.rank,
                    "targets": list(self.targets),
                    "expert_mapping": self.mapping,
                },
                "train": {"seq_len": self.seq_len, "gradient_checkpointing": self.gc},
            }
        )

    def label(self) -> str:
        gc_text = "gc on" if self.gc else "gc off"
        return f"{self.model} r={self.rank} seq={self.seq_len} {gc_text} {self.mapping}"


ACCEPTANCE = Case("Qwen/Qwen3-30B-A3B", 16, 2048, True, "automap", ("attention", "experts"))


def grid(models: tuple[str, ...], name: str, seqs: tuple[int, ...] = ()) -> list[Case]:
    ranks, default = GRIDS[name]
    seqs = seqs or default
    cases = [Case(m, r, s, g) for m, r, s, g in itertools.product(models, ranks, seqs, GCS)]
    return [ACCEPTANCE, *cases] if name == "full" else cases


def measure(case: Case) -> dict[str, Any]:
    spec = load_spec(case.model)
    cfg = case.config()
    est = analytic(spec, cfg)
    trace = cached_trace(spec, cfg)
    gc.collect()
    error = (est.peak_bytes - trace.peak_bytes) / trace.peak_bytes
    return {
        **asdict(case),
        "analytic_bytes": est.peak_bytes,
        "analytic_phase": est.peak_phase,
        "trace_bytes": trace.peak_bytes,
        "trace_phase": trace.peak_phase,
        "trace_op": trace.peak_op,
        "trace_seconds": round(trace.seconds, 1),
        "relative_error": error,
        "uncalibrated": uncalibrated(spec),  # the plan traces these (no analytic term)
    }


def run(cases: list[Case], show_progress: bool) -> list[dict[str, Any]]:
    from rich.progress import Progress

    rows = []
    with Progress(transient=True, disable=not show_progress) as progress:
        task = progress.add_task("analytic vs trace", total=len(cases))
        for case in cases:
            progress.update(task, description=case.label())
            rows.append(measure(case))
            progress.advance(task)
    return rows


def versions() -> str:
    names = ("torch", "transformers", "peft")
    return ", ".join(f"{n} {metadata.version(n)}" for n in names)


def _case(row: dict[str, Any]) -> Case:
    fields = {k: row[k] for k in Case.__dataclass_fields__}
    return Case(**{**fields, "targets": tuple(fields["targets"])})


def summary(rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """Worst and mean error over the cases the analytic plans (uncalibrated ones apart)."""
    planned = [r for r in rows if not r["uncalibrated"]] or rows
    worst = max(planned, key=lambda r: abs(r["relative_error"]))
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores, "
        f"{bench_env.describe()}",
        "versions": versions(),
        "grid": name,
        "seqs": sorted({r["seq_len"] for r in rows}),
        "cases": len(planned),
        "mean_abs_error": _mean_abs(planned),
        "worst_error": worst["relative_error"],
        "worst_case": _case(worst).label(),
        "within_10pct": sum(abs(r["relative_error"]) <= 0.10 for r in planned),
        "per_model": per_model(rows),
    }


def _mean_abs(rows: list[dict[str, Any]]) -> float:
    return sum(abs(r["relative_error"]) for r in rows) / len(rows)


def per_model(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Worst and mean error per model, and the mixer kinds the plan traces instead."""
    out = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        worst = max(mine, key=lambda r: abs(r["relative_error"]))
        out[model] = {
            "worst_error": worst["relative_error"],
            "mean_abs_error": _mean_abs(mine),
            "uncalibrated": mine[0]["uncalibrated"],
        }
    return out


def record(s: dict[str, Any]) -> None:
    """Add one dated line at the end of this benchmark's section (temp file + rename)."""
    bench_env.append_to_section(RESULTS, SECTION, ABOUT, result_line(s) + "\n")


def result_line(s: dict[str, Any]) -> str:
    line = (
        f"- {s['date']} · {s['machine']} · {s['versions']} · {s['grid']} grid "
        f"(seq {', '.join(map(str, s['seqs']))}), "
        f"{s['cases']} cases: worst {100 * s['worst_error']:+.1f} % ({s['worst_case']}), "
        f"mean |error| {100 * s['mean_abs_error']:.2f} %, "
        f"{s['within_10pct']}/{s['cases']} within 10 %"
    )
    if s["grid"] == "flagships":
        line += "; per model (worst / mean |error|): " + "; ".join(
            _model_text(m, v) for m, v in s["per_model"].items()
        )
    return line


def _model_text(model: str, v: dict[str, Any]) -> str:
    text = f"{model} {100 * v['worst_error']:+.1f} % / {100 * v['mean_abs_error']:.1f} %"
    if v["uncalibrated"]:
        kinds = ", ".join(v["uncalibrated"])
        text += f" (raw analytic; {kinds} uncalibrated: the plan traces it)"
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 small models, r=16, seq 512/2048")
    ap.add_argument(
        "--flagships", action="store_true", help="the newest families, r=16, seq 2048/8192"
    )
    ap.add_argument("--json", action="store_true", help="print every case as JSON")
    ap.add_argument("--models", help="comma list of model ids (default: the grid's)")
    ap.add_argument("--seqs", help="comma list of sequence lengths (default: the grid's)")
    ap.add_argument("--record", action="store_true", help="append to results/trace-and-planner.md")
    ap.add_argument("--smoke", action="store_true", help="the demo base only; never records")
    bench_env.add_argument(ap)
    args = ap.parse_args(argv)
    bench_env.apply()
    name = "flagships" if args.flagships else "quick" if args.quick else "full"
    name = "smoke" if args.smoke else name
    smoke = (str(SHIPPED_DIR),)
    default = {"full": MODELS, "quick": QUICK_MODELS, "flagships": FLAGSHIPS, "smoke": smoke}[name]
    models = tuple(args.models.split(",")) if args.models else default
    seqs = tuple(int(s) for s in args.seqs.split(",")) if args.seqs else ()
    rows = run(grid(models, name, seqs), show_progress=not args.json)
    s = summary(rows, name)
    if args.json:
        print(json.dumps({"summary": s, "cases": rows}, indent=2))
    else:
        for r in rows:
            print(
                f"{100 * r['relative_error']:+6.1f} %  {r['analytic_bytes'] / GiB:8.2f} "
                f"vs {r['trace_bytes'] / GiB:8.2f} GiB  {_case(r).label()}"
                + (" (uncalibrated: plan traces)" if r["uncalibrated"] else "")
            )
        print(f"worst: {100 * s['worst_error']:+.1f} % at {s['worst_case']}; "
              f"mean |error| {100 * s['mean_abs_error']:.2f} %")  # fmt: skip
    if args.record and not args.smoke:  # a smoke figure is no result
        record(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
