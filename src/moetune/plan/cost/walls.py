"""Sizing for the four infrastructure walls of a rented-GPU run (docs/knowledge.md §8).

Each wall cost a whole paid pod when it was found one at a time: hf-xet flaking on big
pulls, a pod volume smaller than the snapshot, an in-pod watchdog shorter than the work,
and a CI job timeout that cancels the job before its teardown steps run. The lint rules
use these functions to warn before launch; the remote lane sizes its pods with the same
ones, so the check and the launch can never disagree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

GB = 1000**3  # disk and pod volumes are sold in decimal GB

# -- wall 1: hf-xet -----------------------------------------------------------------------
# hf-xet downloads of big repos flake ("Background writer channel closed"); below this size
# a retry is cheap, above it a failed pull wastes a pod's setup time.
XET_RISK_BYTES = 10 * GB
XET_ENV = "HF_HUB_DISABLE_XET"

# -- wall 2: pod volume -------------------------------------------------------------------
VOLUME_HEADROOM_FRACTION = 0.25  # hub cache temp files, partial downloads, eval outputs
VOLUME_FIXED_HEADROOM_GB = 10  # pip cache, logs, the moetune checkout
LARGE_MODEL_PARAMS = 30 * 10**9  # at and above this size, never go below the floor
LARGE_MODEL_VOLUME_FLOOR_GB = 200  # a 30B bf16 snapshot is 61 GB; 200 GB has never run out
CHECKPOINTS_KEPT = 2  # HF Trainer save_total_limit moetune uses
CHECKPOINT_BYTES_PER_TRAINABLE = 12  # fp32 adapter weight + two fp32 Adam moments
ADAPTER_BYTES_PER_TRAINABLE = 4  # peft keeps (and saves) adapter weights in fp32
# Trainable share assumed when the recipe has not counted it: above the 3.16 % of
# Qwen3-30B-A3B r=16 auto-mapped, so the volume errs on the large side.
TRAINABLE_FRACTION_GUESS = 0.05

# -- wall 3: in-pod watchdog ----------------------------------------------------------------
# With no estimate: 3 h reaped a 30B pod mid-eval; never fall back below 6 h.
DEFAULT_WATCHDOG_S = 6 * 3600
WATCHDOG_MARGIN = 1.5  # estimates are rough; an overrun must cost time, not the pod

# -- wall 4: CI timeouts --------------------------------------------------------------------
HOSTED_RUNNER_JOB_CAP_MINUTES = 360  # GitHub-hosted runners end any job at 6 h
CI_TEARDOWN_MINUTES = 15  # time the `if: always()` bank/teardown steps need after the step


@dataclass(frozen=True)
class Site:
    """Where a run goes, as the walls see it: plain values the lane fills from its
    provider's traits (plan/ and lint/ know no provider). The default is this machine."""

    remote: bool = False  # a pod elsewhere: the pod walls apply
    default_volume_gb: int | None = None  # the volume a pod gets when none is configured
    default_watchdog_s: int | None = None  # the deadline it gets when none is configured
    setup_s: float = 0.0  # paid time before the first step
    title: str = "this machine"  # how messages name it ("RunPod")


class _Sized(Protocol):
    """What the sizing needs from a ModelSpec (structural, so callers can pass stubs)."""

    @property
    def total_params(self) -> int: ...


def snapshot_bytes(spec: _Sized, bytes_per_param: int = 2) -> int:
    """Bytes the hub snapshot takes on disk: bf16 weights (an upper bound for fp8/mxfp4 repos)."""
    return spec.total_params * bytes_per_param


def trainable_estimate(spec: _Sized, trainable_params: int | None = None) -> int:
    """The recipe's trainable count when known, else a deliberately generous guess."""
    if trainable_params is not None:
        return trainable_params
    return int(spec.total_params * TRAINABLE_FRACTION_GUESS)


def required_volume_bytes(
    spec: _Sized, trainable_params: int | None = None, checkpoints_kept: int = CHECKPOINTS_KEPT
) -> int:
    """Snapshot + kept checkpoints + final adapter, before headroom."""
    trainable = trainable_estimate(spec, trainable_params)
    checkpoints = checkpoints_kept * trainable * CHECKPOINT_BYTES_PER_TRAINABLE
    adapter = trainable * ADAPTER_BYTES_PER_TRAINABLE
    return snapshot_bytes(spec) + checkpoints + adapter


def required_volume_gb(
    spec: _Sized, trainable_params: int | None = None, checkpoints_kept: int = CHECKPOINTS_KEPT
) -> int:
    """Pod volume (GB) that holds the run with headroom; >= 200 GB for a >= 30B model."""
    need = required_volume_bytes(spec, trainable_params, checkpoints_kept)
    sized = math.ceil(need * (1 + VOLUME_HEADROOM_FRACTION) / GB) + VOLUME_FIXED_HEADROOM_GB
    if spec.total_params >= LARGE_MODEL_PARAMS:
        return max(sized, LARGE_MODEL_VOLUME_FLOOR_GB)
    return sized


def effective_volume_gb(site: Site, volume_gb: int | None) -> int | None:
    """The volume a run will really get: the configured one, or the site's default; None
    when neither is known."""
    return volume_gb if volume_gb is not None else site.default_volume_gb


def required_watchdog_s(
    estimated_train_s: float, estimated_eval_s: float, margin: float = WATCHDOG_MARGIN
) -> int:
    """A watchdog deadline that lets training and eval finish: (train + eval) x margin."""
    return math.ceil((estimated_train_s + estimated_eval_s) * margin)


def effective_watchdog_s(site: Site, watchdog_s: int | None) -> int | None:
    """The deadline a pod will really have: the configured one, or the site's default."""
    return watchdog_s if watchdog_s is not None else site.default_watchdog_s


def max_step_timeout_minutes(job_timeout_minutes: int) -> int:
    """The longest step timeout that still leaves the teardown steps time inside the job."""
    return max(1, job_timeout_minutes - CI_TEARDOWN_MINUTES)


def xet_disabled(env: Mapping[str, str]) -> bool:
    """True when huggingface_hub will skip hf-xet (it reads this once, at import)."""
    return env.get(XET_ENV, "").upper() in ("1", "ON", "YES", "TRUE")  # no strip: hub does not


def xet_risky(spec: _Sized) -> bool:
    """Whether the snapshot is big enough for an hf-xet flake to cost a pod."""
    return snapshot_bytes(spec) >= XET_RISK_BYTES
