"""plan, lint, train, eval, gate and export as functions: each is the entry function its
CLI command calls, given the same RunConfig, returning what the command renders. Named
`plan_run`, `lint_run`, … because `moetune.plan`, `moetune.lint`, … are the stages'
packages (a function named like one would be replaced by the package once it loads)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from moetune.api.configure import ConfigLike, path_arg, run_config
from moetune.errors import ConfigError, clip
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
    if cards is not None and (isinstance(cards, str) or not all(isinstance(c, str) for c in cards)):
        raise ConfigError(  # a str would be planned letter by letter ("unknown card 'H'")
            f"cards={clip(repr(cards), 80)} is not a list of card ids",
            'pass cards=["H100-80GB"] (`moetune cards` lists them)',
        )
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
    count(limit, "limit", optional=True)
    chosen = path_arg(adapter, "adapter", "an adapter dir") if adapter is not None else None
    cfg = run_config(config, **sections)
    return run_eval(cfg, chosen, limit=limit, overwrite=overwrite, progress=progress)


def gate_results(
    results: str | Path, *, alpha: float | None = None, promote: bool = False
) -> dict[str, Any]:
    """`moetune gate`: GO / NO-GO / INCONCLUSIVE from a results dir `evaluate` wrote;
    `promote`: on GO, mark the adapter promoted (`promoted` names the marker, else None)."""
    doc = decide(path_arg(results, "results", "a results dir of `moetune eval`"), alpha)
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
    count(items, "items")
    opts = export_options(dtype=dtype, extra=options)
    chosen = path_arg(items_file, "items_file", "a JSONL file") if items_file is not None else None
    checking = CheckOptions(items=items, items_file=chosen) if check else None
    source_dir = path_arg(source, "source", "a run dir or a peft adapter dir")
    return export(source_dir, format, path_arg(out, "out", "a new folder"), opts, checking, base)


def push_run(run_dir: str | Path, repo: str, **options: Any) -> dict[str, Any]:
    """`moetune push`: the adapter (or `export=` one of its exports) uploaded to `repo` with
    its model card; private unless `private=False`, refused unless promoted (`unpromoted=True`
    pushes it anyway, and the card says so). Options are PushOptions' fields."""
    unknown = sorted(set(options) - {f.name for f in fields(PushOptions)})
    if unknown:
        raise ConfigError(f"push_run has no option {', '.join(unknown)}",
                          "use the options PushOptions lists (export, private, unpromoted, "
                          "base_model, license, results_dir, ledger)")  # fmt: skip
    if not isinstance(repo, str):
        raise ConfigError(f"repo={clip(repr(repo), 80)} is not a Hub repo id", 'pass "user/name"')
    for name in ("results_dir", "ledger"):
        if options.get(name) is not None:
            options[name] = path_arg(options[name], name, "a path")
    run = path_arg(run_dir, "run_dir", "the output.dir of a run")
    return push(run, PushOptions(repo=repo, **options))


def count(value: Any, name: str, *, optional: bool = False) -> None:
    """A count argument: a positive int (None where `optional`), never a str or bool that
    would fail later as a TypeError in a comparison."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={clip(repr(value), 40)} is not a positive number",
                          f"pass {name} >= 1")  # fmt: skip
