"""Shared fixtures: tiny random MoE configs; never touches the network."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# OpenMP threads that spin at barriers slow tiny CPU training 10-50x whenever another
# process shares the cores; passive waiting keeps the suite's time stable on CI.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The plan's cpu card reads host.json from the user's config dir: tests see no such file
# (defaults) unless one writes its own (never created: the dir does not exist).
os.environ.setdefault("MOETUNE_HOST_FILE", str(Path(__file__).parent / ".no-host" / "host.json"))


@pytest.fixture(scope="session", autouse=True)
def no_dead_man_switch_left(tmp_path_factory):
    """A lane test whose fake pod "dies" leaves that pod's dead-man switch sleeping (a real
    pod would take it along): after the session, end every process group that runs in
    one of this session's temp dirs, so nothing of the suite keeps running."""
    yield
    base = str(tmp_path_factory.getbasetemp())
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            inside = os.readlink(proc / "cwd").startswith(base)
            group = os.getpgid(int(proc.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if inside and group not in (os.getpgrp(), 1):
            try:
                os.killpg(group, signal.SIGTERM)
            except OSError:
                continue
