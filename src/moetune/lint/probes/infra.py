"""Probes of the infrastructure walls of a rented-GPU run: a card too small, hf-xet, a
volume too small, watchdogs and CI timeouts.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import warnings
from typing import TYPE_CHECKING

from moetune.lint.probes.tiny import _version
from moetune.lint.registry import ProbeOutcome, ProbeUnavailable

if TYPE_CHECKING:
    pass


def card_too_small() -> ProbeOutcome:
    """An allocation beyond the card's memory fails; PyTorch does not spill to host RAM."""
    # lazy: heavy to import (torch)
    import torch

    if not torch.cuda.is_available():
        raise ProbeUnavailable("needs a CUDA device (run the gpu tier on a GPU machine)")
    _, total = torch.cuda.mem_get_info()
    try:
        block = torch.empty(total + 2**30, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as err:
        return ProbeOutcome(True, f"allocating total+1 GiB raised OutOfMemoryError: {err}"[:300])
    del block
    return ProbeOutcome(False, f"allocated {total + 2**30} bytes on a {total}-byte card")


def card_not_here() -> ProbeOutcome:
    """Without a CUDA device torch reports none, and a run asking for "auto" gets the CPU:
    nothing fails, the step is only hundreds of times slower."""
    # lazy: heavy to import (torch)
    import torch

    if torch.cuda.is_available():
        raise ProbeUnavailable("needs a host without CUDA (this one has a CUDA device)")
    where = torch.empty(1).device  # where a run with no device named computes
    return ProbeOutcome(
        where.type == "cpu",
        f"torch {torch.__version__} (built for CUDA {torch.version.cuda}): "
        f"cuda.is_available() False, tensors land on {where}",
    )


_XET_SCRIPT = """
import os, importlib.util
from huggingface_hub import constants
os.environ["HF_HUB_DISABLE_XET"] = "1"
from huggingface_hub import constants as again
print(again.HF_HUB_DISABLE_XET, importlib.util.find_spec("hf_xet") is not None)
"""


def hub_xet_enabled() -> ProbeOutcome:
    """hf-xet is on by default and HF_HUB_DISABLE_XET set after import is ignored."""
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _XET_SCRIPT], capture_output=True, text=True, env=env, timeout=60
    )
    if proc.returncode != 0:
        return ProbeOutcome(False, f"probe script failed: {proc.stderr.strip()[-300:]}")
    late_flag, xet_installed = proc.stdout.split()
    evidence = (
        f"huggingface_hub {_version('huggingface_hub')}: HF_HUB_DISABLE_XET set after import "
        f"reads {late_flag}; hf_xet installed: {xet_installed}"
    )
    return ProbeOutcome(late_flag == "False" and xet_installed == "True", evidence)


def volume_too_small() -> ProbeOutcome:
    """The hub only warns when the disk is too small; the download then dies mid-way."""
    # lazy: heavy to import (huggingface_hub)
    from huggingface_hub import file_download

    check = getattr(file_download, "_check_disk_space", None)
    if check is None:
        return ProbeOutcome(False, "huggingface_hub no longer has _check_disk_space")
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check(10**18, tmp)  # an exabyte never fits
    warned = [str(w.message)[:80] for w in caught]
    return ProbeOutcome(bool(warned), f"_check_disk_space(1 EB) did not raise; warned: {warned}")


def watchdog_too_short() -> ProbeOutcome:
    raise ProbeUnavailable(
        "in-pod watchdog behaviour needs a pod; the sizing is covered by the check() tests"
    )


def ci_step_timeout_missing() -> ProbeOutcome:
    raise ProbeUnavailable(
        "GitHub Actions timeout semantics cannot run offline; covered by the check() tests"
    )
