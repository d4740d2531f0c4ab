"""Which torch build this machine needs, and the pip arguments that install it.

`make setup` runs this file on its own (`python src/moetune/lint/torch_index.py`) before
moetune is installed, so it imports nothing but the standard library; `moetune doctor` and
the CARD-NOT-HERE rule name the same command. The choice is `choose` (pure: one case per
platform is tested without the hardware); `probe` reads the machine.

What the choice relies on (docs/install.md has the sources):
- PyPI's Linux x86-64 torch wheel is a CUDA build, its aarch64 wheel a CPU-only build, so a
  GH200 / GB200 / DGX Spark (GB10) gets CUDA only from PyTorch's own index
  (download.pytorch.org/whl/cuXXX, which holds aarch64 CUDA wheels);
- the NVIDIA driver runs a CUDA build no newer than the "CUDA Version" nvidia-smi prints;
- macOS wheels on PyPI carry MPS (Apple silicon); there is no torch >= 2.6 for Intel Macs;
- ROCm builds live at download.pytorch.org/whl/rocmX.Y.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

INDEX = "https://download.pytorch.org/whl"
# PyTorch's CUDA indexes, newest first, with the driver CUDA version each needs
CUDA_INDEXES: tuple[tuple[str, tuple[int, int]], ...] = (
    ("cu130", (13, 0)),
    ("cu128", (12, 8)),
    ("cu126", (12, 6)),
)
OVERRIDE = "MOETUNE_TORCH"  # cpu | cu128 | rocm6.4 | pypi: this build, whatever the machine


@dataclass(frozen=True)
class Machine:
    system: str  # platform.system(): Linux | Darwin | Windows
    machine: str  # platform.machine(): x86_64 | aarch64 | arm64 | AMD64
    cuda_driver: tuple[int, int] | None  # nvidia-smi's "CUDA Version"; None: no NVIDIA GPU
    rocm: tuple[int, int] | None = None  # /opt/rocm's version; None: no ROCm


@dataclass(frozen=True)
class Choice:
    build: str  # cu128 | cpu | rocm6.4 | mps | pypi
    pip_args: tuple[str, ...]  # after `pip install torch...`: where it comes from
    why: str


def choose(m: Machine, override: str | None = None) -> Choice:
    """The torch build for `m` (or the one `override` names) and its pip arguments."""
    if override:
        return _named(override)
    arm = m.machine.lower() in ("aarch64", "arm64")
    if m.system == "Darwin":
        if not arm:
            raise SystemExit("torch >= 2.6 has no Intel-Mac wheels: use Apple silicon or Linux")
        return Choice("mps", (), "Apple silicon: PyPI's macOS wheel carries MPS (Metal)")
    if m.cuda_driver is not None:
        return _cuda(m.cuda_driver, arm)
    if m.rocm is not None and not arm:
        tag = f"rocm{m.rocm[0]}.{m.rocm[1]}"
        return Choice(tag, ("--index-url", f"{INDEX}/{tag}"), f"ROCm {m.rocm[0]}.{m.rocm[1]}")
    return Choice("cpu", ("--index-url", f"{INDEX}/cpu"), "no NVIDIA or AMD GPU: the CPU build")


def _cuda(driver: tuple[int, int], arm: bool) -> Choice:
    """The newest CUDA index the driver runs; the index, not PyPI, on both arches (PyPI's
    aarch64 wheel is CPU-only, and naming the index keeps x86-64 on the same CUDA)."""
    for tag, needs in CUDA_INDEXES:
        if driver >= needs:
            where = "aarch64 (GH200 / GB200 / GB10)" if arm else "x86-64"
            why = f"NVIDIA driver for CUDA {driver[0]}.{driver[1]} on {where}: the {tag} build"
            return Choice(tag, ("--index-url", f"{INDEX}/{tag}"), why)
    oldest = CUDA_INDEXES[-1][1]
    raise SystemExit(
        f"the NVIDIA driver runs CUDA {driver[0]}.{driver[1]}, older than any torch build "
        f"here needs ({oldest[0]}.{oldest[1]}): update the driver, or {OVERRIDE}=cpu"
    )


def _named(build: str) -> Choice:
    if build == "pypi":
        return Choice("pypi", (), f"{OVERRIDE}=pypi: PyPI's default wheel")
    if build in ("cpu", *(t for t, _ in CUDA_INDEXES)) or re.fullmatch(r"rocm\d+\.\d+", build):
        return Choice(build, ("--index-url", f"{INDEX}/{build}"), f"{OVERRIDE}={build}")
    raise SystemExit(f"{OVERRIDE}={build!r}: use cpu, pypi, rocmX.Y or one of "
                     f"{', '.join(t for t, _ in CUDA_INDEXES)}")  # fmt: skip


def _version(text: str | None, pattern: str) -> tuple[int, int] | None:
    match = re.search(pattern, text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def _nvidia_smi() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        return subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def probe() -> Machine:
    """This machine: its OS and arch, the CUDA its NVIDIA driver runs, its ROCm."""
    rocm_file = Path("/opt/rocm/.info/version")
    rocm = rocm_file.read_text() if rocm_file.is_file() else None
    return Machine(
        system=platform.system(),
        machine=platform.machine(),
        cuda_driver=_version(_nvidia_smi(), r"CUDA Version:\s*(\d+)\.(\d+)"),
        rocm=_version(rocm, r"^(\d+)\.(\d+)"),
    )


def main() -> None:
    """Print the pip arguments for this machine's torch (stdout) and why (stderr)."""
    choice = choose(probe(), os.environ.get(OVERRIDE))
    print(f"torch build: {choice.build} – {choice.why}", file=sys.stderr)
    print(" ".join(choice.pip_args))


if __name__ == "__main__":
    main()
