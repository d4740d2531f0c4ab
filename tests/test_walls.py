"""Sizing for the four infrastructure walls (moetune.plan.cost.walls)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from moetune.lane.providers import site_of
from moetune.plan.cost import walls

RUNPOD_VOLUME_GB = 40  # what a RunPod pod gets without volumeInGb (the provider's trait)


@dataclass(frozen=True)
class Sized:
    total_params: int


B = 10**9


def test_snapshot_is_bf16_bytes() -> None:
    assert walls.snapshot_bytes(Sized(30_532_122_624)) == 61_064_245_248  # Qwen3-30B-A3B


def test_volume_for_a_30b_model_never_goes_below_the_floor() -> None:
    assert walls.required_volume_gb(Sized(30_532_122_624)) == walls.LARGE_MODEL_VOLUME_FLOOR_GB


def test_volume_adds_checkpoints_adapter_and_headroom() -> None:
    spec = Sized(10 * B)
    trainable = 100_000_000
    raw = 20 * B + 2 * trainable * 12 + trainable * 4  # snapshot + 2 checkpoints + adapter
    assert walls.required_volume_bytes(spec, trainable) == raw
    expected = -(-raw * 1.25 // walls.GB) + walls.VOLUME_FIXED_HEADROOM_GB
    assert walls.required_volume_gb(spec, trainable) == expected


def test_volume_guess_is_generous_without_a_trainable_count() -> None:
    spec = Sized(10 * B)
    assert walls.required_volume_gb(spec) > walls.required_volume_gb(spec, 100_000_000)


def test_volume_exceeds_the_runpod_default_for_the_reference_model() -> None:
    assert walls.required_volume_gb(Sized(30 * B)) > RUNPOD_VOLUME_GB


def test_volume_small_model_fits_the_default() -> None:
    assert walls.required_volume_gb(Sized(1 * B)) <= RUNPOD_VOLUME_GB


def test_the_runpod_default_volume_is_its_trait() -> None:
    assert site_of("runpod").default_volume_gb == RUNPOD_VOLUME_GB


@pytest.mark.parametrize(
    ("provider", "volume", "expected"),
    [("runpod", None, 40), ("runpod", 120, 120), ("local", None, None), ("ssh", 80, 80)],
)
def test_effective_volume(provider: str, volume: int | None, expected: int | None) -> None:
    assert walls.effective_volume_gb(site_of(provider), volume) == expected


def test_watchdog_is_work_times_margin() -> None:
    assert walls.required_watchdog_s(3600, 1800) == 8100
    assert walls.required_watchdog_s(3600, 1800, margin=2.0) == 10800


@pytest.mark.parametrize(
    ("provider", "deadline", "expected"),
    [("runpod", None, 6 * 3600), ("runpod", 100, 100), ("local", None, None), ("ssh", None, None)],
)
def test_effective_watchdog(provider: str, deadline: int | None, expected: int | None) -> None:
    assert walls.effective_watchdog_s(site_of(provider), deadline) == expected


def test_step_timeout_leaves_teardown_time() -> None:
    assert walls.max_step_timeout_minutes(360) == 360 - walls.CI_TEARDOWN_MINUTES
    assert walls.max_step_timeout_minutes(5) == 1


@pytest.mark.parametrize(
    ("value", "disabled"),
    [("1", True), ("true", True), ("YES", True), ("on", True), ("0", False), ("", False)],
)
def test_xet_disabled_reads_like_huggingface_hub(value: str, disabled: bool) -> None:
    assert walls.xet_disabled({walls.XET_ENV: value}) is disabled


def test_xet_disabled_when_unset_is_false() -> None:
    assert walls.xet_disabled({}) is False


def test_xet_risk_threshold() -> None:
    assert walls.xet_risky(Sized(5 * B))  # 10 GB in bf16
    assert not walls.xet_risky(Sized(4 * B))


@pytest.mark.parametrize("value", ["1", "true", "True", "YES", "on", "0", "false", "", " 1"])
def test_xet_disabled_agrees_with_huggingface_hub(value: str) -> None:
    from huggingface_hub.constants import _is_true

    assert walls.xet_disabled({walls.XET_ENV: value}) is _is_true(value)
