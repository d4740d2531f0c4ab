"""`lora.stack: mlx`: moetune's recipe trained by mlx-lm (Apple silicon, or Linux CPU).

The run, top to bottom:

1. the same preflight as the peft path (`setup.prepare`: spec, plan, lint – MLX-NO-BACKEND,
   MLX-TRANSFORMERS-PIN … stop it – every data row checked, the run dir's first files);
2. the base converted for mlx-lm into `mlx/model` (config fields mlx-lm needs filled from
   the spec; float32 on mlx's CPU backend; data.chat_template as its template), the rows
   the torch stack would train on – data.sources mixed, the eval split – written in
   mlx-lm's format into `mlx/data` (train/mlx/data.py), and moetune's mlx recipe with the
   run's hyperparameters as `mlx/lora.yaml`;
3. the coverage audit reads mlx-lm's own trainable-parameter list after it applied the
   recipe's LoRA (experts adapted, router not) – below 100 % nothing trains;
4. mlx-lm trains (`mlx_lm.lora`'s train_model, the YAML merged over its defaults as its CLI
   does); its loss reports become metrics.jsonl rows;
5. the adapter is converted to peft format into `adapter/` (mlx_format.mlx_to_peft), so
   `moetune eval` / `gate` score it on the same ladder as a peft run, and summary.json
   comes last.

mlx-lm keeps no optimizer state in its checkpoints, so an mlx run does not resume.
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rich.console import Console
from rich.markup import escape

from moetune.config import RunConfig
from moetune.data import SFT_FORMATS
from moetune.data.cap import char_cap
from moetune.io import atomic_write_json, atomic_write_text
from moetune.lint.rules.mlx import mlx_backend
from moetune.model import get_family
from moetune.recipe.audit import PARTS, CoverageReport, CoverageRow, requested_kinds
from moetune.recipe.mlx import make_mlx_recipe, mlx_yaml
from moetune.train.errors import TrainError
from moetune.train.mlx.base import hf_to_mlx, set_chat_template
from moetune.train.mlx.data import mlx_rows, refuse_streaming, write_rows
from moetune.train.mlx.format import mlx_to_peft
from moetune.train.model import require_full_coverage
from moetune.train.rundir.checkpoint import RunDir, inspect_run
from moetune.train.setup import Setup, prepare
from moetune.train.trainer import TrainResult


def train_mlx(
    cfg: RunConfig,
    resume: bool,
    allow_errors: bool,
    replace: tuple[bool, bool],
    progress: bool,
) -> TrainResult:
    """Train `cfg` with mlx-lm; the module docstring lists the steps."""
    refuse_unsupported(cfg)
    started = time.perf_counter()
    run = inspect_run(cfg, resume, *replace)
    if resume:
        raise TrainError(
            "lora.stack=mlx runs cannot resume: mlx-lm saves no optimizer state",
            "start the run again with --overwrite (or a new output.dir)",
        )
    console = Console(stderr=True, quiet=not progress)
    setup = prepare(cfg, run, False, allow_errors)
    work = run.root / "mlx"
    config = write_inputs(cfg, setup, work)
    args = SimpleNamespace(**_with_defaults(config))
    model, report = audited_model(args, cfg, setup, run)
    announce(console, cfg, setup, report, args)
    loop = fit(args, model, run, console, progress)
    mlx_to_peft(work / "adapters", run.adapter, cfg.model.id, overwrite=True)
    result = TrainResult(
        run_dir=str(run.root),
        adapter_dir=str(run.adapter),
        steps=int(args.iters),
        final_loss=loop["final_loss"],
        coverage=report.coverage,
        router_changed=report.router_adapted,
        seconds=round(time.perf_counter() - started, 3),
        peak_memory_bytes=loop["peak_memory_bytes"],
        planned_peak_bytes=setup.planned_peak_bytes,
        errors_overridden=setup.overridden,
        warnings=setup.notes,
        tokens=loop["tokens"],
        tokens_per_s=loop["tokens_per_s"],
        loop_seconds=loop["loop_seconds"],
        device=f"mlx-{_backend()}",
    )
    write_summary(run, result, setup, report)
    return result


def refuse_unsupported(cfg: RunConfig) -> None:
    """What mlx-lm's LoRA trainer cannot do, refused before anything is written."""
    if cfg.train.method != "sft":
        raise TrainError(
            f"lora.stack=mlx trains sft only, not train.method={cfg.train.method}",
            "set lora.stack: peft for dpo / grpo (TRL), or train.method: sft",
        )
    if cfg.train.nproc > 1:
        raise TrainError(
            f"lora.stack=mlx runs in one process, not train.nproc={cfg.train.nproc}",
            "set train.nproc: 1, or lora.stack: peft for several processes",
        )
    if cfg.output.report_to:  # mlx-lm's trainer has no transformers integrations
        raise TrainError(
            f"lora.stack=mlx logs to metrics.jsonl only, not output.report_to="
            f"{','.join(cfg.output.report_to)}",
            "set lora.stack: peft to log to trackers, or output.report_to: []",
        )
    refuse_streaming(cfg)


# ---------------------------------------------------------------- inputs


def write_inputs(cfg: RunConfig, setup: Setup, work: Path) -> dict[str, Any]:
    """mlx/model, mlx/data (the torch stack's rows, train/mlx/data.py) and mlx/lora.yaml;
    returns the YAML's config."""
    cap = char_cap(setup.tokenizer, cfg.train.seq_len)  # a huge row cut as the torch stack cuts it
    rows = mlx_rows(cfg, SFT_FORMATS, cap)  # refuse_unsupported: sft only
    hf_to_mlx(cfg.model.id, work / "model", overwrite=True)
    if cfg.model.tokenizer:  # mlx-lm reads the model dir's: the run's own, as checked
        setup.tokenizer.save_pretrained(work / "model")
    if rows.template:
        set_chat_template(work / "model", rows.template)
    write_rows(work / "data", rows)
    recipe = make_mlx_recipe(setup.spec, cfg.lora, cfg.train, cfg.data, rows=len(rows.train))
    config: dict[str, Any] = recipe["config"] | {
        "model": str(work / "model"),
        "data": str(work / "data"),
        "adapter_path": str(work / "adapters"),
        "mask_prompt": cfg.data.completion_only_loss and rows.masks_prompt,
        "val_batches": 1,
    }
    config["steps_per_eval"] = config.get("iters", 1000)  # validate at the start and the end
    atomic_write_text(work / "lora.yaml", mlx_yaml(config, recipe["notes"]))
    return config


def _with_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """The YAML over mlx-lm's own defaults, as `mlx_lm.lora --config` merges them."""
    # lazy: heavy to import (mlx_lm)
    from mlx_lm.lora import CONFIG_DEFAULTS  # type: ignore[import-not-found]

    return {**CONFIG_DEFAULTS, **config}


def _backend() -> str:

    return mlx_backend().backend or "none"


# ---------------------------------------------------------------- coverage


def audited_model(
    args: SimpleNamespace, cfg: RunConfig, setup: Setup, run: RunDir
) -> tuple[Any, CoverageReport]:
    """The converted base as mlx-lm loads it, audited the way mlx-lm will train it: LoRA
    applied to a lazily loaded copy, its trainable parameters read back (coverage.json)."""
    # lazy: heavy to import (mlx, mlx_lm)
    from mlx.utils import tree_flatten  # type: ignore[import-not-found]
    from mlx_lm.tuner.utils import linear_to_lora_layers  # type: ignore[import-not-found]
    from mlx_lm.utils import load  # type: ignore[import-not-found]

    with _quiet_stdout(False):
        probe = load(args.model, lazy=True)[0]
        probe.freeze()
        linear_to_lora_layers(probe, args.num_layers, args.lora_parameters)
    flat: Any = tree_flatten(probe.trainable_parameters())
    trainable = {name: int(value.size) for name, value in flat}
    report = mlx_coverage(trainable, setup, cfg, int(args.lora_parameters["rank"]))
    atomic_write_json(run.coverage, {**report.to_json(), "source": "mlx-lm trainable_parameters()"})
    require_full_coverage(report)
    with _quiet_stdout(False):
        model = load(args.model)[0]
    return model, report


def mlx_coverage(
    trainable: dict[str, int], setup: Setup, cfg: RunConfig, rank: int
) -> CoverageReport:
    """Per layer and requested kind, each of the family's mlx-lm modules and whether mlx-lm
    made it trainable; the router's state from the same list."""

    spec = setup.spec
    family = get_family(spec.model_type)
    paths, prefix = family.paths_of(spec), family.layers_prefix
    adapted = {k.rsplit(".", 1)[0] for k in trainable if k.endswith(".lora_a")}
    rows = [
        CoverageRow(i, kind, key, rank if f"{prefix}.{i}.{key}" in adapted else None)
        for kind in requested_kinds(cfg.lora)
        for i in PARTS[kind].layers(spec)
        for key in PARTS[kind].mlx(paths)
    ]
    routers = [f"{prefix}.{i}.{r}." for i in spec.moe_layers for r in paths.mlx_router]
    touched = {p for p in routers for k in trainable if k.startswith(p)}
    router = {
        i: "lora" if any(p.startswith(f"{prefix}.{i}.") for p in touched) else "frozen"
        for i in spec.moe_layers
    }
    return CoverageReport(
        model=spec.name,
        kinds=requested_kinds(cfg.lora),
        rows=tuple(rows),
        absent={},
        router=router,
        trainable_params=sum(trainable.values()),
        total_params=spec.total_params,
        num_layers=spec.num_layers,
        ranks={kind: (rank,) for kind in requested_kinds(cfg.lora)},
    )


def announce(
    console: Console, cfg: RunConfig, setup: Setup, report: CoverageReport, args: SimpleNamespace
) -> None:
    line = (
        f"[bold]train[/] {escape(setup.spec.name)} with mlx-lm ({_backend()}) · "
        f"{setup.data.rows} {setup.data.format} rows · {args.iters} iters at lr "
        f"{args.learning_rate:g} · LoRA on {report.adapted}/{report.expected} targets "
        f"(mlx-lm's trainable parameters) · router "
        f"{'adapted' if report.router_adapted else 'frozen'}"
    )
    console.print(line, highlight=False)


# ---------------------------------------------------------------- training


def fit(
    args: SimpleNamespace, model: Any, run: RunDir, console: Console, progress: bool
) -> dict[str, Any]:
    """mlx-lm's train_model on the YAML's datasets; metrics.jsonl from its reports."""
    # lazy: heavy to import (mlx, mlx_lm, numpy)
    import mlx.core as mx  # type: ignore[import-not-found]
    import numpy as np
    from mlx_lm.lora import train_model  # type: ignore[import-not-found]
    from mlx_lm.tuner.datasets import load_dataset  # type: ignore[import-not-found]
    from mlx_lm.utils import load_tokenizer  # type: ignore[import-not-found]

    np.random.seed(args.seed)  # as mlx_lm.lora.run
    tokenizer = load_tokenizer(Path(args.model))
    with _quiet_stdout(progress):
        train_set, valid_set, _ = load_dataset(args, tokenizer)
    reports = MetricsReports(run.metrics.append)
    mx.reset_peak_memory()
    started = time.perf_counter()
    with _quiet_stdout(progress):
        train_model(args, model, train_set, valid_set, reports.callback())
    seconds = time.perf_counter() - started
    tokens = int(reports.last.get("tokens", 0))
    return {
        "final_loss": reports.last.get("loss"),
        "peak_memory_bytes": int(mx.get_peak_memory()),
        "tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
        "loop_seconds": round(seconds, 3),
    }


class MetricsReports:
    """mlx-lm's loss reports as metrics.jsonl rows (step, loss, lr, tokens, memory)."""

    def __init__(self, write: Any) -> None:
        self.write = write
        self.last: dict[str, Any] = {}

    def callback(self) -> Any:
        # lazy: heavy to import (mlx_lm)
        from mlx_lm.tuner.trainer import TrainingCallback  # type: ignore[import-not-found]

        outer = self

        class _Reports(TrainingCallback):  # type: ignore[misc]
            def on_train_loss_report(self, info: dict[str, Any]) -> None:
                outer.row({
                    "step": info["iteration"], "loss": float(info["train_loss"]),
                    "lr": float(info["learning_rate"]), "tokens": int(info["trained_tokens"]),
                    "tokens_per_s": round(float(info["tokens_per_second"]), 1),
                    "memory_bytes": int(float(info["peak_memory"]) * 1e9),
                })  # fmt: skip

            def on_val_loss_report(self, info: dict[str, Any]) -> None:
                outer.row({"step": info["iteration"], "eval_loss": float(info["val_loss"])})

        return _Reports()

    def row(self, row: dict[str, Any]) -> None:
        self.write(row)
        self.last = {**self.last, **row}


@contextlib.contextmanager
def _quiet_stdout(show: bool) -> Any:
    """mlx-lm prints its progress on stdout; moetune's stdout is for its own output (--json),
    so it goes to stderr when shown and nowhere otherwise."""
    with contextlib.redirect_stdout(sys.stderr if show else io.StringIO()):
        yield


# ---------------------------------------------------------------- outputs


def write_summary(run: RunDir, result: TrainResult, setup: Setup, report: CoverageReport) -> None:
    """summary.json, last: its presence marks the run finished."""

    summary = {
        "result": result.to_json(),
        "stack": "mlx",
        "mlx": {**mlx_backend().to_json(), "config": str(run.root / "mlx" / "lora.yaml")},
        "router": {"trainable": False, "changed": report.router_adapted, "changed_layers": []},
        "placement": setup.place.to_json(),
        "data": setup.data.to_json(),
        "coverage_by_kind": report.to_json()["by_kind"],
        "engine": "mlx-lm",
    }
    atomic_write_json(run.summary, summary)
