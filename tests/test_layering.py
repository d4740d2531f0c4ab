"""Stage layering: nothing below the lane imports it (design.md, "a stage never imports a
stage above it"). Read from the source with ast, so lazy imports inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import moetune

PACKAGE = Path(moetune.__file__).parent
BELOW_LANE = ("model", "plan", "recipe", "engine", "train", "evaluate")


def imported_modules(source: str, package: str) -> set[str]:
    """Every absolute module name `source` (a module of `package`) imports, at any depth."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def lane_imports(stage: str) -> list[str]:
    hits = []
    for path in sorted((PACKAGE / stage).rglob("*.py")):
        package = ".".join(("moetune", *path.relative_to(PACKAGE).parent.parts))
        for name in imported_modules(path.read_text(), package):
            if name == "moetune.lane" or name.startswith("moetune.lane."):
                hits.append(f"{path.relative_to(PACKAGE)} imports {name}")
    return hits


@pytest.mark.parametrize("stage", BELOW_LANE)
def test_no_stage_below_the_lane_imports_it(stage: str) -> None:
    assert (PACKAGE / stage).is_dir()
    assert lane_imports(stage) == []


def test_the_walker_sees_lazy_and_relative_imports() -> None:
    """The check above would pass vacuously if the walker missed imports inside functions."""
    lazy = "def f():\n    from moetune.lane import guard\n"
    assert "moetune.lane.guard" in imported_modules(lazy, "moetune.recipe")
    relative = "from ...lane.providers import base\nimport moetune.lane\n"
    names = imported_modules(relative, "moetune.recipe.sub")
    assert {"moetune.lane.providers.base", "moetune.lane"} <= names
    assert "moetune.plan.walls" in imported_modules((PACKAGE / "lane/launch.py").read_text(), "")
