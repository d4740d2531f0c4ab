"""Probes of the offload traps (lint/rules/offload.py), on the installed torch and safetensors."""

from __future__ import annotations

import tempfile
from pathlib import Path

from moetune.lint.registry import ProbeOutcome

MiB = 1024**2


def _rss() -> int:
    import psutil  # lazy: imported only when the probe runs

    return int(psutil.Process().memory_info().rss)


def host_ram_short() -> ProbeOutcome:
    """Host memory is committed when touched, not when allocated: a plan larger than the
    host does not fail at `torch.empty` but later, mid-step, when the pages are written –
    on Linux as the OOM killer's SIGKILL, with no Python traceback."""
    import torch  # lazy: heavy to import

    size = 256 * MiB
    before = _rss()
    block = torch.empty(size, dtype=torch.uint8)
    allocated = _rss() - before
    block.fill_(1)
    touched = _rss() - before
    evidence = (
        f"torch {torch.__version__}: torch.empty(256 MiB) added {allocated / MiB:.0f} MiB RSS, "
        f"writing it {touched / MiB:.0f} MiB"
    )
    return ProbeOutcome(allocated < size // 4 <= touched, evidence)


def disk_offload_reads_in_place() -> ProbeOutcome:
    """safetensors maps the file: a tensor read with `safe_open` adds only the pages it
    touches, so disk offload streams from the files where they lie – they must sit whole on
    a local disk (a download or a quantised copy needs that space first)."""
    # lazy: heavy to import (torch, safetensors)
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "experts.safetensors"
        save_file({"w": torch.ones(64 * MiB // 2, dtype=torch.bfloat16)}, str(path))
        before = _rss()
        with safe_open(str(path), framework="pt") as f:
            tensor = f.get_tensor("w")
            added = _rss() - before
            del tensor
    evidence = f"get_tensor of a 64 MiB tensor added {added / MiB:.1f} MiB RSS (file-backed)"
    return ProbeOutcome(added < 16 * MiB, evidence)
