"""Thread settings every benchmark pins before torch loads, so a figure does not depend on
who else uses the machine.

OpenMP threads that spin at barriers (the default active wait) slow small CPU kernels 10×
or more whenever another process shares the cores: the engine benchmark measured split
LoRA at 0.77× of peft with active wait and 2.12× with passive wait on one loaded machine.
So a benchmark imports this module first (ruff's isort keeps it on top: `force-to-top`):
it sets OMP_WAIT_POLICY=PASSIVE and OMP/MKL thread counts from the script's `--threads N`
(default DEFAULT_THREADS) before torch reads them, and `apply()` sets torch's intra-op
threads once torch is loaded. Imported where torch is already loaded (a test calling a
benchmark's main in-process), it changes nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_THREADS = 2
# Figures go to one topic page each (RESULTS.md is only their index): a page stays readable
# and a record touches no other topic's text.
RESULTS_DIR = Path(__file__).with_name("results")


def _threads_from(argv: list[str]) -> int:
    for i, arg in enumerate(argv):
        if arg == "--threads" and i + 1 < len(argv):
            return max(1, int(argv[i + 1]))
        if arg.startswith("--threads="):
            return max(1, int(arg.split("=", 1)[1]))
    return DEFAULT_THREADS


THREADS = _threads_from(sys.argv[1:])
PINNED = "torch" not in sys.modules
if PINNED:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the CLI does (cli/common.py)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(THREADS)


def add_argument(parser: argparse.ArgumentParser) -> None:
    """The `--threads` option every benchmark takes (read above, before argparse runs)."""
    parser.add_argument(
        "--threads", type=int, default=DEFAULT_THREADS,
        help=f"CPU threads for torch and OpenMP (default {DEFAULT_THREADS}; wait policy passive)",
    )  # fmt: skip


def apply() -> int:
    """torch's intra-op threads as pinned (only in a benchmark's own process)."""
    if PINNED:
        import torch  # loaded by now in every benchmark; imported here so this module stays first

        torch.set_num_threads(THREADS)
    return THREADS


def results_page(topic: str) -> Path:
    """benchmarks/results/<topic>.md: the page a benchmark's `--record` writes (or reads)."""
    return RESULTS_DIR / f"{topic}.md"


def describe() -> str:
    """For results lines: how the threads were set when this figure was measured."""
    wait = os.environ.get("OMP_WAIT_POLICY", "(unset: active)")
    return f"{THREADS} threads, OMP_WAIT_POLICY={wait}"


def write_results(results: Path, body: str) -> None:
    """A results page replaced by `body`, written to a temp file and renamed: an interrupted
    record leaves the page as it was. Every benchmark writes its page through this (or
    append_results / append_to_section) and only when asked with `--record`
    (tests/test_benchmarks.py)."""
    tmp = results.with_name(results.name + ".tmp")
    tmp.write_text(body, encoding="utf-8")
    os.replace(tmp, results)


def append_results(results: Path, head: str, text: str) -> None:
    """`text` at the end of a results page under `head` (added once)."""
    body = results.read_text(encoding="utf-8") if results.exists() else ""
    body = body.rstrip("\n") + "\n\n" + (head + "\n\n" if head not in body else "") + text + "\n"
    write_results(results, body)


RESULTS_HEADER = "# Benchmark results (every figure with its machine and date)\n"


def append_to_section(results: Path, section: str, about: str, block: str) -> None:
    """`block` at the end of `section` of a results page, before the next `## ` heading (the
    page and the section, with its `about` paragraph, made where missing)."""
    text = results.read_text(encoding="utf-8") if results.exists() else RESULTS_HEADER
    if section not in text:
        text = text.rstrip("\n") + f"\n\n{section}\n\n{about}\n"
    head, _, tail = text.partition(section)
    body, sep, rest = tail.partition("\n## ")
    after = f"\n## {rest}" if sep else ""
    write_results(results, f"{head}{section}{body.rstrip()}\n\n{block}{after}")


def drop_cache(path: Path) -> None:
    """fsync a written file and let the kernel drop its pages (they would only evict others')."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
