"""Rules for the machine and the four walls of a rented pod (sizing in moetune.plan.cost.walls)."""

from __future__ import annotations

from pathlib import Path

from moetune.lint.doctor import torch_build, why_not_here
from moetune.lint.probes import infra as probes
from moetune.lint.registry import Hit, LintContext, register_rule
from moetune.plan.cost import walls
from moetune.plan.hardware import get_card
from moetune.units import gib


def _remote(ctx: LintContext) -> bool:
    return ctx.site.remote


def _downloaded(model_id: str) -> bool:
    """A local dir, or a repo with a snapshot already in the hub cache: no big pull ahead."""
    if Path(model_id).exists():
        return True
    # lazy: heavy to import (huggingface_hub)
    from huggingface_hub import constants

    repo = Path(constants.HF_HUB_CACHE) / f"models--{model_id.replace('/', '--')}"
    return (repo / "snapshots").is_dir()


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h"


def _gb(n_bytes: int) -> str:
    return f"{n_bytes / walls.GB:,.1f} GB"


@register_rule(
    "CARD-TOO-SMALL",
    "error",
    "planned peak exceeds the card's usable memory",
    probe=probes.card_too_small,
    libraries=("torch",),
)
def card_too_small(ctx: LintContext) -> Hit | None:
    peak, usable = ctx.peak_bytes, ctx.card_usable_bytes
    if peak is None or usable is None or peak <= usable:
        return None
    card = ctx.card_id or "the card"
    return Hit(
        f"planned peak {gib(peak)} exceeds the {gib(usable)} {card} gives PyTorch "
        f"(short by {gib(peak - usable)}): CUDA out of memory in the first step",
        "follow `moetune plan`'s recommendations (gradient checkpointing, shorter "
        "train.seq_len, explicit expert mapping) or pick a larger hardware.card",
        "hardware.card",
    )


@register_rule(
    "HUB-XET-ENABLED",
    "warn",
    "a big snapshot downloads through hf-xet, which flakes on big pulls",
    probe=probes.hub_xet_enabled,
    libraries=("huggingface_hub", "hf-xet"),
)
def xet_enabled(ctx: LintContext) -> Hit | None:
    spec, remote = ctx.spec, _remote(ctx)
    if spec is None or not walls.xet_risky(spec):
        return None
    if walls.xet_disabled(ctx.config.lane.env if remote else ctx.env):
        return None
    if not remote and _downloaded(ctx.config.model.id):
        return None  # a pod always starts empty; here the snapshot may already be cached
    where = "lane.env" if remote else "the environment"
    return Hit(
        f"the {_gb(walls.snapshot_bytes(spec))} snapshot downloads through hf-xet, which fails "
        "on big pulls ('Background writer channel closed') and costs the pod's setup",
        f"set {walls.XET_ENV}=1 in {where} (huggingface_hub reads it once, at import)",
        "lane.env" if remote else None,
        None if remote else "info",
    )


@register_rule(
    "VOLUME-TOO-SMALL",
    "error",
    "pod volume smaller than snapshot + checkpoints + adapter",
    probe=probes.volume_too_small,
    libraries=("huggingface_hub",),
)
def volume_too_small(ctx: LintContext) -> Hit | None:
    lane, spec = ctx.config.lane, ctx.spec
    volume = walls.effective_volume_gb(ctx.site, lane.volume_gb)
    if spec is None or volume is None:
        return None
    required = walls.required_volume_gb(spec, ctx.trainable_params)
    if volume >= required:
        return None
    default = f" ({ctx.site.title} default)" if lane.volume_gb is None else ""
    return Hit(
        f"pod volume {volume} GB{default} < {required} GB needed for the "
        f"{_gb(walls.snapshot_bytes(spec))} bf16 snapshot, checkpoints and adapter: the "
        "download dies with `OSError: [Errno 122] Disk quota exceeded`",
        f"set lane.volume_gb: {required}",
        "lane.volume_gb",
    )


@register_rule(
    "WATCHDOG-TOO-SHORT",
    "error",
    "in-pod watchdog shorter than train + eval",
    probe=probes.watchdog_too_short,
)
def watchdog_too_short(ctx: LintContext) -> Hit | None:
    lane = ctx.config.lane
    deadline = walls.effective_watchdog_s(ctx.site, lane.watchdog_s)
    if not _remote(ctx) or deadline is None or ctx.estimated_train_s is None:
        return None
    required = walls.required_watchdog_s(ctx.estimated_train_s, lane.estimated_eval_s)
    if deadline >= required:
        return None
    default = f" ({ctx.site.title} default)" if lane.watchdog_s is None else ""
    return Hit(
        f"the in-pod watchdog fires at {_hours(deadline)}{default}, but (train "
        f"{_hours(ctx.estimated_train_s)} + eval {_hours(lane.estimated_eval_s)}) × "
        f"{walls.WATCHDOG_MARGIN} margin needs {_hours(required)}: the pod is reaped mid-run",
        f"set lane.watchdog_s: {required}",
        "lane.watchdog_s",
    )


@register_rule(
    "CI-STEP-TIMEOUT-MISSING",
    "error",
    "CI job timeout without a shorter step timeout",
    probe=probes.ci_step_timeout_missing,
)
def ci_step_timeout(ctx: LintContext) -> Hit | None:
    lane = ctx.config.lane
    job, step = lane.ci_job_timeout_minutes, lane.ci_step_timeout_minutes
    if job is None or (step is not None and step < job):
        return None
    have = "no step timeout" if step is None else f"step timeout {step} min ≥ the job's"
    return Hit(
        f"CI job timeout {job} min with {have}: at the deadline the whole job is cancelled, "
        "the bank/teardown `if: always()` steps get no time, and the adapter is lost",
        f"set lane.ci_step_timeout_minutes: {walls.max_step_timeout_minutes(job)} "
        f"(job − {walls.CI_TEARDOWN_MINUTES} min for teardown)",
        "lane.ci_step_timeout_minutes",
    )


@register_rule(
    "CARD-NOT-HERE",
    "error",
    "hardware.card is a GPU this machine (or its torch) cannot use",
    probe=probes.card_not_here,
    libraries=("torch",),
)
def card_not_here(ctx: LintContext) -> Hit | None:
    why = None if _remote(ctx) else why_not_here(ctx.config, torch_build())
    if why is None:
        return None
    card = get_card(str(ctx.config.hardware.card))
    kind = "an Apple GPU" if card.kind == "mps" else "a CUDA card"
    return Hit(
        f"hardware.card {card.id} is {kind}, but {why}: train would run on the CPU "
        "(or stop) instead",
        "install the torch build for this machine (docs/install.md; `make setup` picks it and "
        "`moetune doctor` shows it), or set train.device: cpu to train here on purpose, or send "
        "the run to a pod (lane.provider)",
        "hardware.card",
    )
