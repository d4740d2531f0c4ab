"""docs/notebooks/quickstart.ipynb: its structure and the API names it calls (fast), and
executed top to bottom by a Jupyter kernel with its printed results checked (slow: ~90 s
on 2 cores – the demo base learns `dup` for 150 steps)."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

import moetune

NOTEBOOK = Path(__file__).resolve().parent.parent / "docs" / "notebooks" / "quickstart.ipynb"


def _code(nb) -> list[str]:
    return [cell.source for cell in nb.cells if cell.cell_type == "code"]


def _read():
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    return nb


def test_the_notebook_is_valid_and_calls_only_public_api_names() -> None:
    nb = _read()
    trees = [ast.parse(source) for source in _code(nb)]
    used = {
        node.attr
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "moetune"
    } - {"__file__"}
    assert used and used <= set(moetune.__all__), used - set(moetune.__all__)
    # the steps the page promises, each through the API
    assert {
        "run_config",
        "plan_run",
        "lint_run",
        "load",
        "callbacks",
        "eval_run",
        "export_run",
    } <= used
    assert not any(cell.get("outputs") for cell in nb.cells if cell.cell_type == "code")


@pytest.mark.slow
def test_the_notebook_runs_top_to_bottom(tmp_path: Path, monkeypatch) -> None:
    """Executed as a user would (nbclient, a fresh kernel, its own working dir): the plan
    fits, the load is audited, the adapter learns `dup` (GO) and the merged export serves
    what was trained."""
    nbclient = pytest.importorskip("nbclient")
    nb = _read()
    src = str(Path(moetune.__file__).resolve().parent.parent)
    # the kernel imports this moetune (a checkout's src/ too, not only an installed one)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    text = "".join(
        out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
        for out in cell.outputs
    )  # fmt: skip
    assert "fits an H100: True" in text
    assert "engine moetune, coverage 100%, router frozen" in text
    assert "verdict: GO" in text
    rel = float(re.search(r"logits rel ([0-9.e+-]+) \(tolerance", text)[1])  # type: ignore[index]
    assert rel < 0.03
    assert "greedy equal 100%" in text
    assert (tmp_path / "notebook-run" / "adapter" / "adapter_model.safetensors").is_file()
