"""docs/config.md is the schema: generated from RunConfig (config/reference.py), committed,
and checked equal here, so a new or changed field cannot leave the page behind."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import schema_rows
from moetune.config.reference import reference_markdown

PAGE = Path(__file__).resolve().parent.parent / "docs" / "config.md"
ROW = re.compile(r"^\| `(?P<path>[^`]+)` \| (?P<type>.+?) \| `(?P<default>.*)` \| (?P<what>.*) \|$")


def test_the_committed_page_is_the_generated_one() -> None:
    cli = CliRunner().invoke(app, ["schema", "--markdown"])
    assert cli.exit_code == 0, cli.output
    assert cli.output == reference_markdown()
    assert PAGE.read_text(encoding="utf-8") == cli.output, (
        "docs/config.md is stale: run `python docs/gen_examples.py` (or `moetune schema "
        "--markdown > docs/config.md`)"
    )


def test_every_field_has_one_row_with_its_type_default_and_meaning() -> None:
    rows = {m["path"]: m for line in reference_markdown().splitlines() if (m := ROW.match(line))}
    assert list(rows) == [path for path, _, _ in schema_rows()]  # each once, schema order
    assert all(m["what"] for m in rows.values()), "a field without a description"
    targets = rows["lora.targets"]
    assert targets["type"].startswith("list of `attention` \\| `experts`")
    assert targets["default"] == '["attention", "experts", "dense", "shared"]'
    assert rows["lora.rank"]["type"] == "int; a positive integer (> 0)"
    assert rows["lora.alpha"]["default"] == "null" and "or null" in rows["lora.alpha"]["type"]
    assert any(path.startswith("eval.rungs[].") for path in rows)  # a list's item fields
