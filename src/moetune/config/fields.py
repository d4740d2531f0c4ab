"""A RunConfig field found by its `section.field` path, and the one reading of a comma list
for a list field: `--set lora.targets=attention,experts` and `--targets attention,experts`
both go through `comma_list`, so a flag and `--set` accept the same text."""

from __future__ import annotations

from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from moetune.config.sections import RunConfig


def bare(annotation: Any) -> Any:
    """The annotation without `| None` (a field that may be unset)."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    is_optional = len(args) == 1 and type(None) in get_args(annotation)
    return args[0] if is_optional and get_origin(annotation) is not Literal else annotation


def field_at(path: str) -> FieldInfo | None:
    """The RunConfig field at `section.field` (nested sections included); None where the
    path names no field (a key inside a mapping such as lane.env, or a typo that validation
    names)."""
    cls: Any = RunConfig
    *sections, leaf = path.split(".")
    for name in sections:
        info = cls.model_fields.get(name)
        cls = bare(info.annotation) if info is not None else None
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            return None
    found: FieldInfo | None = cls.model_fields.get(leaf)
    return found


def lists_values(path: str) -> bool:
    """Whether the field at `path` is a list of plain values (names, numbers, commands) –
    not of sections like eval.rungs, which a comma list cannot spell."""
    info = field_at(path)
    annotation = bare(info.annotation) if info is not None else None
    if get_origin(annotation) is not list:
        return False
    item = (get_args(annotation) or (Any,))[0]
    return not (isinstance(item, type) and issubclass(item, BaseModel))


def comma_list(text: str) -> list[str]:
    """`a, b,c` as ["a", "b", "c"]; empty parts dropped (`--targets ,` names no part)."""
    return [part.strip() for part in text.split(",") if part.strip()]


def field_rule(info: FieldInfo) -> str | None:
    """What a constrained number accepts, in words (`a positive integer (> 0)`): the first
    one-line rule of config/base.py among the field's validators, else None."""
    meta = [*info.metadata, *getattr(bare(info.annotation), "__metadata__", ())]
    docs = [getattr(getattr(m, "func", None), "__doc__", None) for m in meta]
    rule = next((d for d in docs if d and d.startswith("must be")), None)
    return rule.removeprefix("must be ") if rule else None
