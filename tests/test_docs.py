"""The front door stays true: README's size and two commands, links that resolve, the CLI
examples in README/docs still shaped like the CLI's real output, and every reference the
docs and docstrings make (package floors, source paths, knowledge sections) still there."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import sys
import unicodedata
from pathlib import Path

import pytest

import moetune

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(moetune.__file__).parent
_spec = importlib.util.spec_from_file_location("gen_examples", ROOT / "docs" / "gen_examples.py")
assert _spec is not None and _spec.loader is not None
gen = importlib.util.module_from_spec(_spec)
sys.modules["gen_examples"] = gen  # dataclasses look their module up by name
_spec.loader.exec_module(gen)

PAGES = gen.pages()
EXAMPLES = gen.examples()
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(`{3,}).*?^\1\s*$", re.S | re.M)


def _id(ex: object) -> str:
    return f"{ex.path.relative_to(ROOT)}: {ex.command}"  # type: ignore[attr-defined]


# --- README ------------------------------------------------------------------------------


def test_readme_is_a_front_door_with_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    bash = "\n".join(re.findall(r"```bash\n(.*?)```", text, re.S))
    commands = [line.split("#")[0].strip() for line in bash.splitlines()]
    assert "make quickstart" in commands and "make test" in commands
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^quickstart:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


# --- links -------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc gives a heading (what mkdocs links check against)."""
    text = re.sub(r"`|\*\*|\[|\]\([^)]*\)", "", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    prose = FENCE.sub("", page.read_text())
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", prose, re.M)}


def links(page: Path) -> list[str]:
    prose = re.sub(r"`[^`\n]*`", "", FENCE.sub("", page.read_text()))
    return [t for t in LINK.findall(prose) if not re.match(r"[a-z]+:", t)]


def test_slug_matches_markdowns_toc() -> None:
    assert slug("8. Renting a GPU pod without wasting money") == (
        "8-renting-a-gpu-pod-without-wasting-money"
    )
    assert slug("Several GPUs: what each device holds (`--gpus N`)") == (
        "several-gpus-what-each-device-holds-gpus-n"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert broken == []


def test_the_link_check_sees_broken_links(tmp_path: Path) -> None:
    page = tmp_path / "a.md"
    page.write_text("# Top\n[ok](a.md#top) [gone](b.md) `[code](x.md)`\n```\n[f](y.md)\n```\n")
    assert links(page) == ["a.md#top", "b.md"]
    assert anchors(page) == {"top"}


# --- examples ----------------------------------------------------------------------------


def cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"[┃│]", line.strip())[1:-1]]


def shape(lines: list[str]) -> tuple[str, list[list[str]], list[str]]:
    """First line, table header rows, and the labels of table rows (first cell)."""
    heads = [cells(line) for line in lines if line.startswith("┃")]
    labels = [cells(line)[0] for line in lines if line.startswith("│") and cells(line)[0]]
    return (lines[0] if lines else "", heads, labels)


def test_examples_are_marked_in_the_readme_and_the_stage_pages() -> None:
    where = {ex.path.name for ex in EXAMPLES}
    assert {"README.md", "plan.md", "lint.md", "recipe.md", "export.md"} <= where
    assert all(ex.body.startswith(f"$ {ex.command}\n") for ex in EXAMPLES), "run gen_examples.py"


@pytest.mark.parametrize("ex", EXAMPLES, ids=_id)
def test_example_has_the_commands_shape(ex: object) -> None:
    shown, fresh = ex.shown, ex.fresh()  # type: ignore[attr-defined]
    assert shown and fresh
    assert shape(shown) == shape(fresh), "stale example: run python docs/gen_examples.py"
    if ex.command.split()[1] == "inspect":  # type: ignore[attr-defined]
        assert shown == fresh  # parameter counts are facts of the model, not estimates


def test_an_example_leaves_the_console_and_environment_as_they_were(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from moetune.cli.common import console

    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    before = console.width
    lines = gen.output.__wrapped__("moetune inspect src/moetune/demo/base_model")
    assert lines[0].startswith("src/moetune/demo/base_model (qwen3_moe)")
    assert console.width == before and os.environ["HF_HUB_DISABLE_XET"] == "1"


def test_shape_tells_tables_apart() -> None:
    one = ["title", "┃ card ┃ fits ┃", "│ H200 │  yes │", "│      │      │"]
    assert shape(one) == ("title", [["card", "fits"]], ["H200"])
    assert shape(one) != shape([*one[:2], "│ H100 │  yes │"])
    assert gen.keep(["a", "b", "c"], "tail", 2) == ["b", "c"]
    assert gen.keep(["a", "b", "c"], "head", 1) == ["a"]


# --- references --------------------------------------------------------------------------


def test_every_package_is_on_one_floor_of_architecture_md() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    order = next(line for line in text.splitlines() if line.startswith("errors, "))
    listed = [name.strip() for name in re.split(r"[<,]", order)]
    modules = {p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("__")}
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert sorted(listed) == sorted(modules | packages)


SOURCE_PATH = re.compile(r"(?:src/moetune|benchmarks|tests|configs)/[\w/.-]+\.\w+")
# architecture.md cites paths in backticks, relative to src/moetune or the root (a bare x.py:
# anywhere below them)
CODE_PATH = re.compile(r"`([\w.-]+(?:/[\w.-]*)+|[\w-]+\.py)`")
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def missing(paths: set[str], *bases: Path) -> list[str]:
    """The cited paths found under none of `bases` (a bare file name: anywhere below them)."""

    def found(path: str, base: Path) -> bool:
        return (base / path).exists() if "/" in path else any(base.rglob(path))

    return sorted(p for p in paths if not any(found(p, base) for base in bases))


def test_source_paths_the_docs_cite_exist() -> None:
    cited = {path for page in PAGES for path in SOURCE_PATH.findall(page.read_text())}
    assert cited and missing(cited, ROOT) == []


def test_every_path_architecture_md_cites_exists() -> None:
    cited = set(CODE_PATH.findall(FENCE.sub("", ARCHITECTURE.read_text())))
    assert len(cited) > 200 and missing(cited, PACKAGE, ROOT) == []


def test_the_path_check_sees_a_path_that_is_gone() -> None:
    cited = set(CODE_PATH.findall("`plan/trace/bytes.py` `plan/tracker.py` `moves.py` `gone.py`"))
    assert missing(cited, PACKAGE) == ["gone.py", "plan/tracker.py"]
    assert CODE_PATH.findall("`model/catalog/<name>.json` `lora.stack`") == []


def _module_level(tree: ast.Module) -> list[tuple[str, ast.expr | None]]:
    """(name, value) of each plain `NAME = …` / `NAME: T = …` at the module's top level."""
    assigned: list[tuple[str, ast.expr | None]] = []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            assigned += [(t.id, node.value) for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            assigned.append((node.target.id, node.value))
    return assigned


def registries() -> set[tuple[str, str]]:
    """(file under src/moetune, name) of every registry: a module-level `Registry(...)`, or a
    public module-level dict, empty at first, that a function fills (`NAME[key] = entry`)."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        where = path.relative_to(PACKAGE).as_posix()
        assigned = _module_level(tree)
        found |= {
            (where, name)
            for name, value in assigned
            if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "Registry"
        }
        empty = {
            name
            for name, value in assigned
            if isinstance(value, ast.Dict) and not value.keys and name.isupper() and name[0] != "_"
        }
        filled = {
            t.value.id
            for fn in ast.walk(tree)
            if isinstance(fn, ast.FunctionDef)
            for node in ast.walk(fn)
            if isinstance(node, ast.Assign)
            for t in node.targets
            if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)
        }
        found |= {(where, name) for name in empty & filled}
    return found


def where_to_add_rows() -> list[list[str]]:
    """The cells of each row of architecture.md's "Where to add things" table."""
    section = ARCHITECTURE.read_text().split("\n## Where to add things\n")[1].split("\n## ")[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[1:]]


def test_every_registry_has_a_row_in_where_to_add_things() -> None:
    rows, found = where_to_add_rows(), registries()
    assert {("engine/stack_files.py", "LAYOUTS"), ("train/launch.py", "STRATEGIES")} <= found
    assert {len(row) for row in rows} == {5}  # to add, write, registry, registered by, test
    lost = [
        f"{path} {name}"
        for path, name in sorted(found)
        if not any(f"`{path}`" in row[2] and f"`{name}`" in row[2] for row in rows)
    ]
    assert len(rows) >= 25 and lost == []


def test_the_changelog_moves_are_done() -> None:
    """Every old path of the changelog is gone (no shims) and every new one is there."""
    text = (ROOT / "docs" / "changelog.md").read_text()
    moves = re.findall(r"^\| `([\w/.]+)` \| (.+) \|$", text, re.M)
    new = {path for _, cell in moves for path in re.findall(r"`([\w/.]+)`", cell)}
    old = {path for path, _ in moves}
    assert len(old) > 70 and missing(old, PACKAGE) == sorted(old)
    assert missing(new, PACKAGE) == []


def test_docstrings_cite_knowledge_sections_that_exist() -> None:
    knowledge = (ROOT / "docs" / "knowledge.md").read_text()
    sections = set(re.findall(r"^## (\d+b?)\. ", knowledge, re.M))
    assert {"3", "5", "8", "12"} <= sections
    cited = set()
    for path in [*PACKAGE.rglob("*.py"), *(ROOT / "tests").glob("*.py")]:
        text = path.read_text()
        bare = re.search(r"(?<!docs/)knowledge(\.md)? §", text)
        assert not bare, f"{path}: cite docs/knowledge.md"
        for refs in re.findall(r"docs/knowledge\.md ((?:§\d+b?(?:, )?)+)", text):
            cited |= set(re.findall(r"§(\d+b?)", refs))
    assert cited and cited <= sections


def _all_pages() -> str:
    return "\n".join(page.read_text() for page in PAGES)


def test_every_command_and_subcommand_is_documented() -> None:
    import typer.main

    from moetune.cli import app

    text = _all_pages()
    missing = []
    for name, command in typer.main.get_command(app).commands.items():  # type: ignore[attr-defined]
        lines = "\n".join(line for line in text.splitlines() if f"moetune {name}" in line)
        missing += [] if lines else [name]
        subs = getattr(command, "commands", {}) or {}
        missing += [f"{name} {sub}" for sub in subs if not re.search(rf"\b{sub}\b", lines)]
    assert missing == []


def test_every_lint_rule_is_on_the_lint_page() -> None:
    from moetune.lint import RULES

    page = (ROOT / "docs" / "lint.md").read_text()
    assert len(RULES) > 20 and sorted(rule for rule in RULES if rule not in page) == []


def test_every_yaml_block_in_the_docs_is_a_valid_run_config() -> None:
    import yaml

    from moetune.config import parse_config

    blocks = re.findall(r"```yaml\n(.*?)```", _all_pages(), re.S)
    assert len(blocks) >= 2
    for block in blocks:
        data = yaml.safe_load(block)
        cfg = parse_config(data)  # raises a ConfigError naming the field on a stale one
        for section, fields in data.items():
            for name, value in fields.items():
                if isinstance(value, str | int | float):
                    assert getattr(getattr(cfg, section), name) == value, f"{section}.{name}"
