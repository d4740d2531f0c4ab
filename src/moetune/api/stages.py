"""plan, lint, train, eval, gate and export as functions: each is the entry function its
CLI command calls, given the same RunConfig, returning what the command renders. Named
`plan_run`, `lint_run`, … because `moetune.plan`, `moetune.lint`, … are the stages'
packages (a function named like one would be replaced by the package once it loads)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from moetune.api.configure import ConfigLike, run_config
from moetune.errors import ConfigError
from moetune.evaluate import gate_results as decide
from moetune.evaluate import promote as promote_adapter
from moetune.evaluate import run_eval
from moetune.export.check import CheckOptions
from moetune.export.pipeline import export
from moetune.export.registry import export_options
from moetune.lane.providers import site_of
from moetune.lint.preflight import lint_run as lint_config
from moetune.model import load_spec
from moetune.plan import make_plan
from moetune.report.push import PushOptions, push
from moetune.train import train as train_run_of

if TYPE_CHECKING:
    from moetune.lint.registry import Finding
    from moetune.plan.fit import MemoryPlan
    from moetune.train.result import TrainResult


def plan_run(
    config: ConfigLike = None,
    /,
    *,
    cards: list[str] | None = None,
    estimator: Literal["analytic", "trace"] = "analytic",
    **sections: Any,
) -> MemoryPlan:
    """`moetune plan`: peak memory by component, the fit per card (`cards`, default the
    catalog's) and per card the best change that fits."""
    cfg = run_config(config, **sections)
    spec = load_spec(cfg.model.id, cfg.model.trust_remote_code)
    return make_plan(spec, cfg, cards=cards, estimator=estimator)


def lint_run(config: ConfigLike = None, /, **sections: Any) -> list[Finding]:
    """`moetune lint`: every known trap the configuration walks into, each with its fix."""
    cfg = run_config(config, **sections)
    findings, _ = lint_config(cfg, site=site_of(cfg.lane.provider))
    return list(findings)


def train_run(
    config: ConfigLike = None,
    /,
    *,
    resume: bool = False,
    allow_errors: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    **sections: Any,
) -> TrainResult:
    """`moetune train` in this process (one GPU, or the CPU): the run dir, adapter, ledger."""
    cfg = run_config(config, **sections)
    return train_run_of(
        cfg, resume=resume, allow_errors=allow_errors, overwrite=overwrite, progress=progress
    )


def eval_run(
    config: ConfigLike = None,
    /,
    *,
    adapter: str | Path | None = None,
    limit: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    **sections: Any,
) -> dict[str, Any]:
    """`moetune eval`: base and adapter (default <output.dir>/adapter) on the same items of
    every eval rung, then the gate; the verdict document `moetune gate` prints."""
    cfg = run_config(config, **sections)
    return run_eval(cfg, adapter, limit=limit, overwrite=overwrite, progress=progress)


def gate_results(
    results: str | Path, *, alpha: float | None = None, promote: bool = False
) -> dict[str, Any]:
    """`moetune gate`: GO / NO-GO / INCONCLUSIVE from a results dir `evaluate` wrote;
    `promote`: on GO, mark the adapter promoted (`promoted` names the marker, else None)."""
    doc = decide(results, alpha)
    marker = promote_adapter(results) if promote and doc["verdict"] == "GO" else None
    return {**doc, "promoted": str(marker) if marker else None}


def export_run(
    source: str | Path,
    format: str,
    out: str | Path,
    *,
    base: str | None = None,
    dtype: str = "auto",
    check: bool = True,
    items: int = 16,
    items_file: str | Path | None = None,
    **options: Any,
) -> dict[str, Any]:
    """`moetune export`: a run dir's (or a peft adapter dir's) adapter as `format` (merged |
    vllm | gguf | mlx) in the new folder `out`, then the served == trained check on `items`
    eval items (`items_file`: a JSONL of {"prompt": …} or {"text": …} rows; default the
    run's eval items; `check=False`: marked unchecked). `options`: the format's own
    (vllm_layout, requantize, survival_floor)."""
    if items < 1:
        raise ConfigError(f"items={items} is not a positive number", "pass items >= 1")
    opts = export_options(dtype=dtype, extra=options)
    chosen = Path(items_file) if items_file is not None else None
    checking = CheckOptions(items=items, items_file=chosen) if check else None
    return export(Path(source), format, Path(out), opts, checking, base)


def push_run(run_dir: str | Path, repo: str, **options: Any) -> dict[str, Any]:
    """`moetune push`: the adapter (or `export=` one of its exports) uploaded to `repo` with
    its model card; private unless `private=False`, refused unless promoted (`unpromoted=True`
    pushes it anyway, and the card says so). Options are PushOptions' fields."""
    return push(run_dir, PushOptions(repo=repo, **options))
