"""The config reference page, docs/config.md, made from RunConfig itself: every field with
its type, default and description, a section a table. `moetune schema --markdown` prints
it; tests/test_config_reference.py checks the committed page equals it, so the page cannot
drift from the schema (a new field: rerun the command into docs/config.md)."""

from __future__ import annotations

import json
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from moetune.config.fields import bare, field_rule
from moetune.config.load import default_text, schema_fields

INTRO = """\
# Config reference

Every field of `run.yaml`, section by section: its type, its default and what it means.
This page is generated from the schema itself (`moetune schema --markdown > docs/config.md`;
a test keeps the two equal), so it lists exactly what the installed version accepts.

A field is set in `run.yaml` as `section: {field: value}`, or on the command line as
`--set section.field=value` (CLI beats YAML beats defaults). A list field takes a YAML
list (`[attention, experts]`) or, on the command line, a comma list
(`--set lora.targets=attention,experts`); a quoted value stays one item. A field written
`a[].b` is field `b` of each item of the list `a`. An unknown key is an error, never
ignored. For how to choose the values that matter most, see
[Choosing lr, batch, epochs and rank](choosing.md).
"""


def type_words(annotation: Any) -> str:
    """A field type as the reader writes it: `list of str`, `` `a` | `b` ``, `int`."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{v}`" for v in args)
    if origin is Annotated:
        return type_words(args[0])
    if origin is list:
        return f"list of {type_words(args[0])}"
    if origin is dict:
        return f"mapping of {type_words(args[0])} to {type_words(args[1])}"
    if origin in (Union, types.UnionType):
        return " or ".join(type_words(a) for a in args)
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return str(getattr(annotation, "__name__", annotation))


def type_text(field: FieldInfo) -> str:
    """The field's type, `or null` where it may be unset, and its number rule."""
    base = bare(field.annotation)
    text = type_words(base) + (" or null" if base is not field.annotation else "")
    rule = field_rule(field)
    return f"{text}; {rule}" if rule else text


def _default(field: FieldInfo) -> str:
    """The default as YAML reads it (JSON is YAML: `false`, `null`, `"bfloat16"`)."""
    if field.is_required():
        return "(required)"
    try:
        return json.dumps(field.get_default(call_default_factory=True), ensure_ascii=False)
    except TypeError:  # not JSON (none of today's fields): as Python writes it
        return default_text(field)


def _cell(text: str) -> str:
    """Text that stays inside one table cell (a `|` would end it)."""
    return " ".join(text.split()).replace("|", "\\|")


def reference_markdown() -> str:
    """docs/config.md: the intro, then a table per top-level section."""
    out = [INTRO]
    section = None
    for path, field in schema_fields():
        top = path.split(".")[0]
        if top != section:
            section = top
            out += [f"\n## {top}\n", "| field | type | default | meaning |", "|---|---|---|---|"]
        default = _cell(_default(field))
        cells = (f"`{path}`", type_text(field), f"`{default}`", _cell(field.description or ""))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"
