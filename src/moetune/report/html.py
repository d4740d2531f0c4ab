"""`build_report(run_dir)`: the run dir (and its eval results) as one self-contained HTML file.

Only config.yaml is required; every other input is optional, and a section whose input is
missing or malformed says "not available (why)" instead of failing – a run that trained but
was not evaluated yet still gets its loss curve. The page loads nothing from anywhere:
figures are PNG data URIs, the CSS is inline, and a Content-Security-Policy forbids every
other source. The template autoescapes, so config strings cannot inject markup, and the
one inline script (which marks whether every figure decoded) is allowed by its hash only.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from jinja2 import Environment, StrictUndefined
from markupsafe import Markup

import moetune.report.plots as plots
from moetune.config import load_yaml
from moetune.io import atomic_write_text, masked, promotion_broken
from moetune.report.examples import failing_examples
from moetune.report.exports import exports_section
from moetune.report.inputs import lookup, missing, read_json, read_jsonl
from moetune.report.out import ReportError, check_out
from moetune.report.shift import shift_section
from moetune.units import human_bytes

# Sets data-rendered on <body>: "ok" once every figure decoded, else "broken:N" plus one
# console error per broken figure – what a headless browser check reads.
RENDER_CHECK = """
window.addEventListener("load", function () {
  var broken = Array.prototype.filter.call(document.images, function (img) {
    return !(img.complete && img.naturalWidth > 0);
  });
  broken.forEach(function (img) {
    console.error("moetune report: figure did not decode: " + img.alt);
  });
  document.body.dataset.rendered = broken.length ? "broken:" + broken.length : "ok";
});
"""

VERDICT_BADGES = {"GO": "go", "NO-GO": "nogo", "INCONCLUSIVE": "inconclusive"}
CONFIG_FIELDS = (  # (label, dotted path in config.yaml) of the config summary
    ("model", "model.id"),
    ("model dtype", "model.dtype"),
    ("objective", "train.method"),
    ("tuning", "train.tuning"),
    ("LoRA rank", "lora.rank"),
    ("LoRA expert rank", "lora.expert_rank"),
    ("LoRA alpha", "lora.alpha"),
    ("engine", "lora.engine"),
    ("experts stored", "model.experts_dtype"),
    ("expert selection", "lora.expert_selection"),
    ("LoRA targets", "lora.targets"),
    ("expert mapping", "lora.expert_mapping"),
    ("train router", "lora.train_router"),
    ("quantization", "train.quantization"),
    ("seq len", "train.seq_len"),
    ("batch size", "train.batch_size"),
    ("grad accum", "train.grad_accum"),
    ("learning rate", "train.learning_rate"),
    ("lr schedule", "train.lr_scheduler"),
    ("max steps", "train.max_steps"),
    ("epochs", "train.epochs"),
    ("gradient checkpointing", "train.gradient_checkpointing"),
    ("train file", "data.train_file"),
    ("eval file", "data.eval_file"),
    ("completion-only loss", "data.completion_only_loss"),
    ("packing", "data.packing"),
)


# ---------------------------------------------------------------- inputs


@dataclass
class Inputs:
    """What the run dir holds; `files` maps a file name to its JSON object or None, and
    `why` says why a missing one is missing."""

    run_dir: Path
    config: dict[str, Any]
    files: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    routing: list[dict[str, Any]] = field(default_factory=list)

    def get(self, name: str) -> dict[str, Any]:
        return self.files.get(name) or {}


def read_config(run_dir: Path) -> dict[str, Any]:
    """config.yaml as a dict: the one input a report cannot do without."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ReportError(
            f"{run_dir} is not a moetune run directory (no config.yaml)",
            "pass the output.dir of a run (the directory `moetune train` wrote)",
        )
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ReportError(
            f"{path} cannot be read: {first}", "restore the run's config.yaml"
        ) from None
    if not isinstance(data, dict):
        raise ReportError(f"{path} does not hold a run config", "restore the run's config.yaml")
    return data


def load_inputs(run_dir: Path, results_dir: Path | None) -> Inputs:
    config = read_config(run_dir)
    configured = lookup(config, "eval.results_dir")
    results = results_dir or (Path(configured) if configured else run_dir / "eval")
    inp = Inputs(run_dir, config)
    paths = [
        run_dir / n
        for n in ("versions.json", "preflight.json", "data.json", "coverage.json", "summary.json")
    ]
    paths += [results / "ladder.json", results / "verdict.json", run_dir / "adapter" / "PROMOTED"]
    for path in paths:
        inp.files[path.name], inp.why[path.name] = read_json(path)
    inp.metrics = read_jsonl(run_dir / "metrics.jsonl")
    inp.routing = read_jsonl(run_dir / "routing.jsonl")
    return inp


# ---------------------------------------------------------------- sections


def guarded(name: str, build: Callable[[Inputs], dict[str, Any]], inp: Inputs) -> dict[str, Any]:
    """A section, or "not available" when its inputs have a shape this report cannot read."""
    try:
        return {"missing": "", **build(inp)}
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        return missing(f"the {name} inputs have an unexpected format: {type(exc).__name__}: {exc}")


def utc(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def mtime_utc(path: Path) -> str:
    return utc(path.stat().st_mtime)


def header(inp: Inputs) -> dict[str, Any]:
    summary = inp.run_dir / "summary.json"
    finished = summary.is_file()
    verdict = inp.get("verdict.json").get("verdict")
    return {
        "run_id": inp.run_dir.resolve().name,
        "model": lookup(inp.config, "model.id"),
        "status": f"finished {mtime_utc(summary)}"
        if finished
        else f"unfinished (no summary.json yet), started {mtime_utc(inp.run_dir / 'config.yaml')}",
        "verdict": str(verdict) if verdict else "not gated",
        "badge": VERDICT_BADGES.get(str(verdict), "none"),
        "promoted": promotion(inp),
    }


def promotion(inp: Inputs) -> str:
    """Whether adapter/PROMOTED exists and was written for this verdict."""
    marker = inp.files.get("PROMOTED")
    if marker is None:
        found = (inp.run_dir / "adapter" / "PROMOTED").is_file()
        return "PROMOTED marker unreadable" if found else "not promoted"
    if why := promotion_broken(inp.run_dir / "adapter"):
        return f"NOT PROMOTED: {why}"
    verdict_hash = inp.get("verdict.json").get("hash")
    if verdict_hash is None:
        return f"promoted (verdict {str(marker.get('verdict_hash'))[:12]}; no verdict.json)"
    if marker.get("verdict_hash") == verdict_hash:
        return f"promoted (verdict {str(verdict_hash)[:12]})"
    return "PROMOTED marker does not match the verdict in the results"


def show(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) or "–"
    return str(value)


def config_value(config: dict[str, Any], path: str) -> str:
    value, rank = lookup(config, path), lookup(config, "lora.rank")
    if path == "lora.alpha" and value is None and isinstance(rank, int):
        return f"{2 * rank} (default: 2 × rank)"
    return show(value)


def preview_rows(preview: Any) -> list[tuple[str, str]]:
    """What `moetune data` showed, from data.json: sources, the loss share and cut rows, and
    the samples with their loss tokens in [brackets]."""
    if not isinstance(preview, dict):
        return []
    mix = ", ".join(f"{s.get('source')}: {s.get('rows')} × {s.get('weight')}"
                    for s in preview.get("sources") or [])  # fmt: skip
    cut = (f"{preview.get('loss_share', 0):.1%} of tokens carry loss · {preview.get('truncated')} "
           f"over seq_len · {preview.get('duplicates')} eval rows also in train")  # fmt: skip
    samples = [
        (f"sample {n}", "".join(f"[{t}]" if loss else t for t, loss in runs))
        for n, runs in enumerate(preview.get("samples") or [], 1)
    ]
    return [("data sources", mix), ("data preview", cut), *samples]


def config_section(inp: Inputs) -> dict[str, Any]:
    rows = [(label, config_value(inp.config, path)) for label, path in CONFIG_FIELDS]
    versions = inp.get("versions.json")
    data, coverage = inp.get("data.json"), inp.get("coverage.json")
    if versions:
        rows.append(("device", f"{versions.get('device')} ({versions.get('precision')})"))
    if data:
        rows.append(
            ("data", f"{data.get('rows')} {data.get('format')} rows, loss on {data.get('loss_on')}")
        )
    rows += preview_rows(data.get("preview") if data else None)
    if coverage:
        rows.append(
            (
                "LoRA coverage",
                f"{coverage.get('adapted')}/{coverage.get('expected')} "
                f"targets ({coverage.get('coverage', 0):.0%})",
            )
        )
    skip = {"device", "precision", "device_name", "device_total_bytes"}
    libs = [(k, show(v)) for k, v in versions.items() if k not in skip]
    return {"rows": rows, "versions": libs, "versions_missing": inp.why["versions.json"]}


def memory_section(inp: Inputs) -> dict[str, Any]:
    """The plan of the configuration that ran (offload, nproc: preflight.json's run_plan,
    else its memory plan) next to the measured peak (summary.json, else metrics.jsonl)."""
    mem = inp.get("summary.json").get("memory") or {}
    plan = inp.get("preflight.json").get("run_plan") or _memory_plan(inp)
    measured, how = mem.get("measured_peak_bytes"), mem.get("measured") or ""
    logged = [r["memory_bytes"] for r in inp.metrics if isinstance(r.get("memory_bytes"), int)]
    if measured is None and logged:  # unfinished run: the largest figure logged so far
        measured, how = max(logged), "largest memory_bytes in metrics.jsonl"
    candidates = (
        (
            f"planned peak ({plan.get('label', 'one device')})",
            mem.get("planned_peak_bytes") or plan.get("peak_bytes"),
            mem.get("compared") or plan.get("compared") or "",
        ),
        (
            "planned required (with overhead)",
            mem.get("planned_required_bytes") or plan.get("required_bytes"),
            "what the plan requires of a card",
        ),
        ("measured peak", measured, _measured_note(how, plan)),
    )
    rows = [(label, value, note) for label, value, note in candidates if isinstance(value, int)]
    if not rows:
        return missing(
            "no memory plan in preflight.json and no measured peak (summary.json, metrics.jsonl)"
        )
    planned = candidates[0][1]
    return {
        "rows": rows,
        "components": [(k, v) for k, v in (plan.get("components") or {}).items() if v],
        "ratio": measured / planned if measured and planned and _alike(how, plan) else None,
        "plot": plots.memory_plot([(label, value) for label, value, _ in rows]),
    }


def _alike(how: str, plan: dict[str, Any]) -> bool:
    """Whether the measured and planned figures count the same thing: a peak RSS holds the
    whole process, which a plan counts only with its process baseline (run dirs from before
    it compared RSS with tensors: no ratio is shown for them)."""
    return how != "process_peak_rss" or "process_baseline" in (plan.get("components") or {})


def _measured_note(how: str, plan: dict[str, Any]) -> str:
    """How the peak was measured; a plan off CUDA counts the whole process, as RSS does."""
    if how == "process_peak_rss" and _alike(how, plan):
        return "process peak RSS (the whole Python process, as the plan counts it)"
    return MEASURED_NOTES.get(how, how)


def _memory_plan(inp: Inputs) -> dict[str, Any]:
    """A run dir from before run_plan: the preflight's memory plan in run_plan's keys."""
    plan = inp.get("preflight.json").get("plan") or {}
    return {**plan, "compared": f"estimator: {plan.get('estimator', '–')}"}


MEASURED_NOTES = {
    "cuda_max_memory_allocated": "torch.cuda.max_memory_allocated",
    "process_peak_rss": "process peak RSS (CPU run: the whole Python process, "
    "not comparable with the tensor plan)",
}


def loss_section(inp: Inputs) -> dict[str, Any]:
    losses = [r for r in inp.metrics if isinstance(r.get("loss"), int | float)]
    if not losses:
        empty = f"no metrics.jsonl in {inp.run_dir}"
        return missing("metrics.jsonl has no loss rows yet" if inp.metrics else empty)
    first, last = losses[0], losses[-1]
    return {
        "plot": plots.loss_plot(inp.metrics),
        "caption": f"{len(losses)} logged steps; loss {first['loss']:.4f} at step "
        f"{first['step']} → {last['loss']:.4f} at step {last['step']}",
    }


def routing_section(inp: Inputs) -> dict[str, Any]:
    """Load fractions per expert, per layer, over the recorded steps."""
    if not inp.routing:
        return missing(
            f"no routing records in {inp.run_dir / 'routing.jsonl'} "
            "(train.routing_every is 0, or no step was recorded yet)"
        )
    steps = [int(row["step"]) for row in inp.routing]
    fractions: dict[int, list[list[float]]] = {}
    collapsed: dict[int, list[int]] = {}
    base = _base_routing(inp)
    for j, row in enumerate(inp.routing):
        for load in row["layers"]:
            counts = load["tokens_per_expert"]
            total = sum(counts) or 1
            column = fractions.setdefault(int(load["layer"]), [[0.0] * len(counts)] * len(steps))
            column[j] = [c / total for c in counts]
            if load.get("collapsed"):
                collapsed.setdefault(int(load["layer"]), []).append(steps[j])
    layers = sorted(fractions)
    shown = plots.pick_layers(layers)
    caption = f"{len(steps)} records, steps {steps[0]}–{steps[-1]}; {len(layers)} MoE layers"
    if len(shown) < len(layers):
        caption += f", showing {len(shown)} evenly spaced: {', '.join(map(str, shown))}"
    return {
        "plot": plots.routing_plot(steps, {layer: fractions[layer] for layer in shown}),
        "caption": caption,
        "collapsed": [
            (layer, show(s), against_base(layer, base)) for layer, s in sorted(collapsed.items())
        ],
    }


def _base_routing(inp: Inputs) -> dict[int, dict[str, Any]]:
    """The base's routing and the drifted layers the run measured (summary.json)."""
    drift = inp.get("summary.json").get("routing") or {}
    base = {int(b["layer"]): dict(b) for b in drift.get("base") or [] if "layer" in b}
    for layer in drift.get("drifted_layers") or []:
        base.setdefault(int(layer), {})["drifted"] = True
    return base


def against_base(layer: int, base: dict[int, dict[str, Any]]) -> str:
    """A collapse is the fine-tune's only where the base did not already route that way."""
    seen = base.get(layer, {})
    if "top1_share" not in seen:
        return "the base's routing was not measured"
    share = f"base {float(seen['top1_share']):.0%}"
    if seen.get("drifted"):
        return f"drifted from the base ({share})"
    return f"as the base already routed ({share}): not the fine-tune's doing"


def ladder_section(inp: Inputs) -> dict[str, Any]:
    ladder = inp.files["ladder.json"]
    if ladder is None:
        return missing(
            f"{inp.why['ladder.json']} – run `moetune eval` first, or pass the results dir"
        )
    return {
        "rungs": [ladder_row(r) for r in ladder["rungs"]],
        "plot": plots.ladder_plot(ladder["rungs"]) if ladder["rungs"] else None,
        "meta": ladder_meta(ladder),
    }


def ladder_meta(ladder: dict[str, Any]) -> str:
    parts = [f"candidate: {ladder.get('adapter')}", f"base: {ladder.get('model')}"]
    when, seconds = ladder.get("time"), ladder.get("seconds")
    if isinstance(when, int | float):
        parts.append(f"evaluated {utc(when)}")
    if isinstance(seconds, int | float):
        parts.append(f"took {seconds:.0f} s")
    return " · ".join(parts)


def score_text(side: Any) -> str:
    """One side (base or candidate) of a rung as score ± stderr."""
    if not isinstance(side, dict):
        return "–"
    stderr = side.get("stderr")
    return num(side.get("score")) + (f" ± {num(stderr, '.2g')}" if stderr is not None else "")


def ladder_row(rung: dict[str, Any]) -> dict[str, Any]:
    row = {k: rung.get(k) for k in ("name", "kind", "role", "unit", "n", "delta", "se_delta")}
    return {
        **row,
        "base": score_text(rung.get("base")),
        "candidate": score_text(rung.get("candidate")),
    }


GATE_KEYS = [
    "name",
    "role",
    "status",
    "delta",
    "se_delta",
    "z",
    "lower",
    "upper",
    "threshold",
    "n",
    "n_needed",
    "base_score",
    "candidate_score",
    "reason",
]


def gate_section(inp: Inputs) -> dict[str, Any]:
    verdict = inp.files["verdict.json"]
    if verdict is None:
        return missing(f"{inp.why['verdict.json']} – run `moetune gate` first")
    return {
        "verdict": str(verdict["verdict"]),
        "badge": VERDICT_BADGES.get(str(verdict["verdict"]), "none"),
        "alpha": verdict.get("alpha"),
        "reason": verdict.get("reason", ""),
        "hash": verdict.get("hash", ""),
        "rungs": [{k: r.get(k) for k in GATE_KEYS} for r in verdict["rungs"]],
        "examples": failing_examples(verdict),
    }


# ---------------------------------------------------------------- rendering


def num(value: Any, spec: str = ".4g") -> str:
    """A number for a table cell; "–" for None, anything else as text."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return show(value)
    return format(value, spec)


def csp() -> str:
    """Nothing may load; figures are data URIs and the one script is allowed by its hash."""
    digest = base64.b64encode(hashlib.sha256(RENDER_CHECK.encode()).digest()).decode()
    return (
        "default-src 'none'; img-src data:; style-src 'unsafe-inline'; "
        f"script-src 'sha256-{digest}'; base-uri 'none'; form-action 'none'"
    )


def render(context: dict[str, Any]) -> str:
    env = Environment(
        autoescape=True, undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True
    )
    env.filters.update(num=num, signed=lambda v: num(v, "+.4g"), bytes=human_bytes)
    text = resources.files("moetune.report").joinpath("template.html.j2").read_text("utf-8")
    return env.from_string(text).render(**context)


SECTIONS: dict[str, Callable[[Inputs], dict[str, Any]]] = {
    "config": config_section,
    "memory": memory_section,
    "loss": loss_section,
    "routing": routing_section,
    "shift": shift_section,
    "ladder": ladder_section,
    "gate": gate_section,
    "exports": exports_section,
}


def build_report(run_dir: Path, out: Path | None = None, results_dir: Path | None = None) -> Path:
    """Write the HTML report of `run_dir` to `out` (default RUN_DIR/report.html) and return
    its path. Eval results come from `results_dir` (default: the config's
    eval.results_dir, else RUN_DIR/eval). Raises ReportError when RUN_DIR is not a run."""
    run_dir = Path(run_dir)
    out = out or run_dir / "report.html"
    inp = load_inputs(run_dir, results_dir)
    check_out(out)  # before rendering: a writable path that holds nothing of the user's
    # secrets masked before HTML escaping, which would hide them from a mask of the page
    context: dict[str, Any] = {
        name: masked(guarded(name, build, inp)) for name, build in SECTIONS.items()
    }
    context.update(
        header=masked(header(inp)),
        csp=csp(),
        script=Markup(RENDER_CHECK),  # a constant: its hash is in the CSP
        generated=utc(datetime.now(tz=timezone.utc).timestamp()),
    )
    atomic_write_text(out, render(context))
    return out
