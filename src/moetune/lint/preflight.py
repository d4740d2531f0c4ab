"""Glue between the preflight stages: a run config from a model id or a run.yaml, and a
lint context filled with the spec and the plan, so `plan`, `lint` and `train` share one path."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from moetune.config import RunConfig, load_config, parse_config
from moetune.io import write_problem
from moetune.ledger import LedgerError
from moetune.lint.registry import LintContext, lint
from moetune.model import load_spec
from moetune.plan import make_plan
from moetune.plan.cost.estimate import estimate
from moetune.plan.cost.walls import Site
from moetune.plan.hardware import get_card

RUN_SUFFIXES = (".yaml", ".yml")


def is_run_file(target: str) -> bool:
    return Path(target).suffix in RUN_SUFFIXES


def resolve_run(target: str, overrides: list[str] | None = None) -> RunConfig:
    """A RunConfig from a run.yaml, or defaults around a model id / path (overrides applied)."""
    if is_run_file(target):
        return load_config(target, overrides)
    return parse_config({"model": {"id": target}}, overrides)


def check_ledger(path: str | Path) -> None:
    """output.ledger must be able to take a row: found before a run, not after it trained."""
    problem = _ledger_problem(Path(path))
    if problem:
        raise LedgerError(
            f"output.ledger {path} {problem}, so no ledger row could be written",
            "set output.ledger to a file in a writable directory (e.g. .moetune/ledger.jsonl)",
        )


def _ledger_problem(path: Path) -> str | None:
    """Why `path` cannot be appended to (with its `.lock` beside it), or None."""
    if path.exists() and not path.is_dir():  # appended to in place: a device takes rows too
        return None if os.access(path, os.W_OK) else "is not writable"
    return write_problem(path)


def lint_context(cfg: RunConfig, spec: Any, plan: Any = None, site: Site | None = None) -> Any:
    """The rules' view of a run: config, spec and – when planned – the peak on the named card.
    `site` (where the run goes) comes from the caller above that knows the providers; by
    default the run is here."""
    ctx = LintContext(config=cfg, spec=spec, site=site or Site())
    if plan is not None:
        ctx.peak_bytes = plan.required_bytes
        ctx.trainable_params = plan.trainable_params
        named = get_card(cfg.hardware.card).id if cfg.hardware.card else ""  # "t4" is T4
        fit = plan.fits.get(named)
        if fit is not None:
            ctx.card_id, ctx.card_usable_bytes = named, fit.usable_bytes
            ctx.peak_bytes = fit.required_bytes
    if spec is not None and cfg.hardware.card:
        # the launch's own estimate: a rate measured on this card (ledger) beats FLOPs
        card = get_card(cfg.hardware.card)
        ctx.estimated_train_s = estimate(spec, cfg, card, cfg.output.ledger).estimated_train_s
    return ctx


def lint_run(
    cfg: RunConfig, estimator: str = "analytic", site: Site | None = None, spec: Any = None
) -> tuple[list[Any], Any]:
    """Run every rule on `cfg` with its spec (loaded here unless the caller has it) and its
    plan (on `hardware.card` when named)."""
    if cfg.model.is_gguf:
        return lint(lint_context(cfg, None, site=site)), None
    spec = spec or load_spec(cfg.model.id, cfg.model.trust_remote_code)
    cards = [cfg.hardware.card] if cfg.hardware.card else None
    plan = make_plan(spec, cfg, cards=cards, estimator=estimator)  # type: ignore[arg-type]
    return lint(lint_context(cfg, spec, plan, site)), plan
