"""Rewrite the CLI examples in README.md, docs/ and the results pages that quote the planner
(`RESULT_PAGES`) with the CLI's real output.

A block kept true is a fenced `text` block right after a marker comment, e.g.
`<!-- example: moetune inspect Qwen/Qwen3-30B-A3B -->`; the marker may end in `| head N`
or `| tail N` to keep part of the output. The block holds `$ <command>` and then what the
command prints at a WIDTH-column terminal. Only fast, offline commands belong in markers
(inspect, plan --estimator analytic, recipe, lint, schema, serve-plan on catalog models);
tests/test_docs.py re-runs each marker and checks the block still has the command's shape.

    python docs/gen_examples.py           # rewrite every marked block
    python docs/gen_examples.py --check   # list the stale ones, exit 1 if any
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WIDTH = 100  # the terminal width the examples are rendered at
MARKER = re.compile(
    r"<!-- example: (?P<cmd>moetune [^|>]+?)(?: \| (?P<cut>head|tail) (?P<n>\d+))? -->\n"
    r"```text\n(?P<body>.*?)```",
    re.S,
)
# The environment an example shows: a fresh shell. HF_HUB_DISABLE_XET would hide the
# HUB-XET-ENABLED finding, so it is unset while the examples run.
UNSET = ("HF_HUB_DISABLE_XET",)


@dataclass(frozen=True)
class Example:
    """One marked block: where it is, the command, which lines it keeps, the text shown."""

    path: Path
    command: str
    cut: str | None
    n: int
    body: str

    @property
    def shown(self) -> list[str]:
        """The output lines of the block, without its `$ command` line."""
        lines = self.body.rstrip("\n").splitlines()
        return lines[1:] if lines and lines[0].startswith("$ ") else lines

    def fresh(self) -> list[str]:
        """What the command prints now, cut as the marker says."""
        return keep(output(self.command), self.cut, self.n)


def pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


# Results pages that quote the planner beside measured or published figures: their marked
# blocks are kept true like the docs' (they are not docs pages: no other docs check runs
# over them).
RESULT_PAGES = (ROOT / "benchmarks" / "results" / "distributed.md",)


def marked_pages() -> list[Path]:
    """Every page whose marked blocks this script keeps true."""
    return [*pages(), *RESULT_PAGES]


def _example(path: Path, m: re.Match[str]) -> Example:
    return Example(path, m["cmd"].strip(), m["cut"], int(m["n"] or 0), m["body"])


def examples(paths: list[Path] | None = None) -> list[Example]:
    """Every marked block of the given pages (default: all of them)."""
    return [
        _example(path, m)
        for path in paths or marked_pages()
        for m in MARKER.finditer(path.read_text())
    ]


def keep(lines: list[str], cut: str | None, n: int) -> list[str]:
    """The first (head) or last (tail) n lines, or all of them."""
    if cut == "head":
        return lines[:n]
    return lines[-n:] if cut == "tail" else lines


def _cuda_host() -> object:
    """A CUDA build with a device: the machine a config naming a CUDA card is linted on.
    The docs are built on a CPU box, where CARD-NOT-HERE would fill every lint example."""
    from moetune.lint.doctor import TorchBuild

    return TorchBuild("2.13.0", "12.8", None, cuda_available=True, mps_available=False)


@contextmanager
def _fresh_shell() -> Iterator[None]:
    import moetune.lint.rules.infra as infra

    saved = {name: os.environ.get(name) for name in (*UNSET, "HF_HUB_OFFLINE")}
    for name in UNSET:
        os.environ.pop(name, None)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # catalog ids only: never the network
    host, infra.torch_build = infra.torch_build, _cuda_host  # type: ignore[assignment]
    try:
        yield
    finally:
        infra.torch_build = host
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@cache
def output(command: str) -> list[str]:
    """The command's stdout lines at a WIDTH-column terminal, run in this process."""
    from typer.testing import CliRunner

    from moetune.cli import app
    from moetune.cli.common import console

    saved = console._width  # rich has no public "width for a while"; put it back after
    console.width = WIDTH
    try:
        with _fresh_shell():
            result = CliRunner().invoke(app, shlex.split(command)[1:], catch_exceptions=False)
    finally:
        console._width = saved
    if result.exit_code not in (0, 1):  # 1: lint's error findings, by design
        raise SystemExit(f"`{command}` exited {result.exit_code}: {result.stderr.strip()}")
    return [line.rstrip() for line in result.stdout.rstrip().splitlines()]  # rich pads the end


def block(example: Example) -> str:
    """The block's new text: the command as typed, then its (cut) output."""
    return "".join(line + "\n" for line in [f"$ {example.command}", *example.fresh()])


def rewrite(path: Path) -> bool:
    """Regenerate every marked block of one page; True when the page changed."""
    text = path.read_text()

    def fresh(m: re.Match[str]) -> str:
        start, end = m.span("body")
        return m[0][: start - m.start()] + block(_example(path, m)) + m[0][end - m.start() :]

    new = MARKER.sub(fresh, text)
    if new != text:
        path.write_text(new)
    return new != text


CONFIG_PAGE = ROOT / "docs" / "config.md"  # the whole page is `moetune schema --markdown`


def config_page() -> str:
    # lazy: as the examples' own import of the CLI, only when the script runs
    from moetune.config.reference import reference_markdown

    return reference_markdown()


def main(argv: list[str]) -> int:
    """Rewrite the pages (and the config reference), or with --check only list the
    out-of-date blocks."""
    if "--check" not in argv:
        for path in marked_pages():
            if rewrite(path):
                print(f"rewrote {path.relative_to(ROOT)}")
        if CONFIG_PAGE.read_text(encoding="utf-8") != config_page():
            CONFIG_PAGE.write_text(config_page(), encoding="utf-8")
            print(f"rewrote {CONFIG_PAGE.relative_to(ROOT)}")
        return 0
    stale = [ex for ex in examples() if ex.shown != ex.fresh()]
    for ex in stale:
        print(f"stale: {ex.path.relative_to(ROOT)}: {ex.command}")
    config_stale = CONFIG_PAGE.read_text(encoding="utf-8") != config_page()
    if config_stale:
        print(f"stale: {CONFIG_PAGE.relative_to(ROOT)}: moetune schema --markdown")
    return 1 if stale or config_stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
