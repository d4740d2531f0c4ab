"""`moetune doctor`: what is installed and known broken; with --calibrate, this host's
rates for the plan's CPU card (lint.calibrate), stored in moetune's config dir."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from moetune.cli.common import JsonOpt, app, console, emit_json, friendly
from moetune.errors import ConfigError, clip
from moetune.units import gib


@app.command()
@friendly
def doctor(
    target: Annotated[
        str | None,
        typer.Argument(
            help="A run.yaml: also report its hardware.card and whether it trains here."
        ),
    ] = None,
    calibrate: Annotated[
        bool,
        typer.Option(
            "--calibrate",
            help="Measure this host (matmul, memcpy, disk read) for `plan`'s cpu card, "
            "and store it (~30 s).",
        ),
    ] = False,
    path: Annotated[
        Path | None,
        typer.Option(help="With --calibrate: dir whose disk is read (default: the HF cache)."),
    ] = None,
    file: Annotated[
        Path | None,
        typer.Option(help="With --calibrate: read this large file instead of writing one."),
    ] = None,
    probe_mib: Annotated[
        int | None,
        typer.Option(min=1, help="With --calibrate: MiB of the disk probe (default 1 GiB)."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Installed versions, known-bad combinations, hub settings, disk and accelerators."""
    if calibrate:
        _calibrate(path, file, (probe_mib or 1024) << 20, as_json)
        return
    given = [f for f, v in (("--path", path), ("--file", file), ("--probe-mib", probe_mib)) if v]
    if given:  # a calibration option alone would be ignored without a word
        raise ConfigError(
            f"{', '.join(given)} only apply with --calibrate", "add --calibrate, or drop them"
        )
    # lazy: the stage loads only when its command runs
    from moetune.lane.providers import site_of
    from moetune.lint.doctor import run_doctor
    from moetune.lint.preflight import resolve_run

    if target and Path(target).is_dir() and not (Path(target) / "config.json").is_file():
        raise ConfigError(  # else read as a model id and reported as if no run was named
            f"{clip(target, 100)} is a directory, neither a run.yaml nor a model (no config.json)",
            "pass a run.yaml (a run dir's is RUN/config.yaml)",
        )
    cfg = resolve_run(target) if target else None
    report = run_doctor(cfg, cfg is not None and site_of(cfg.lane.provider).remote)
    if as_json:
        emit_json(report.to_json())
        return
    _print_report(report)


def _print_report(report: Any) -> None:
    for name, ver in report.versions.items():
        console.print(f"{name:>14} {ver}")
    xet = report.hf_hub_disable_xet
    console.print(
        f"HF_HUB_DISABLE_XET={xet!s:<6} {'ok' if xet == '1' else 'set it to 1 before big pulls'}"
    )
    console.print(f"free disk at {report.cache_dir}: {gib(report.free_disk_bytes)}")
    t = report.torch
    console.print(f"torch {t['version']}: {t['label']} build")
    accel = ", ".join(_device(a) for a in report.accelerators) or "none (CPU only)"
    console.print(f"accelerators: {accel}")
    if report.card is not None:
        card = report.card
        named = f"{card['card']} ({card['compute_dtype']}) " if card["card"] else ""
        console.print(f"hardware.card: {named}– {card['verdict']}", highlight=False, soft_wrap=True)
    mlx = report.mlx
    if mlx.get("mlx_lm"):
        where = mlx["device"] or f"no backend ({mlx['error']})"
        console.print(f"mlx-lm {mlx['mlx_lm']} on mlx {mlx['mlx'] or '(absent)'}: {where}")
    for p in report.problems:
        console.print(f"[red]known bad:[/] {p['message']} – fix: {p['fix']}")


def _device(accel: dict[str, Any]) -> str:
    """ "NVIDIA H200 (H200, 139.8 GiB)": torch's name, the catalog card, its memory."""
    about = [str(accel["card"] or "not in the catalog")] if accel["kind"] == "cuda" else []
    about += [gib(accel["bytes"])] if accel.get("bytes") else []
    return f"{accel['name']} ({', '.join(about)})" if about else str(accel["name"])


def _calibrate(path: Path | None, file: Path | None, probe_bytes: int, as_json: bool) -> None:
    # lazy: the stage loads only when its command runs
    from moetune.lint.calibrate import calibrate_and_save

    profile, stored = calibrate_and_save(path, file, probe_bytes)
    if as_json:
        emit_json({**profile.model_dump(), "stored_at": str(stored)})
        return
    p = profile
    console.print(f"{p.cpu}, {p.cores} cores ({p.threads} threads), {gib(p.ram_bytes)} RAM")
    console.print(f"matmul {p.fp32_gflops:,.1f} GFLOP/s fp32, {p.bf16_gflops:,.1f} bf16")
    console.print(f"memcpy {p.memcpy_gb_per_s:,.2f} GB/s")
    how = "O_DIRECT" if p.disk_direct else "page cache (no O_DIRECT here)"
    console.print(f"disk read {p.disk_read_gb_per_s:,.2f} GB/s at {p.disk_path} ({how})")
    console.print(f"stored in {stored}: `moetune plan --card cpu` plans with it")
