"""The API's configuration: the same RunConfig as run.yaml, given as a RunConfig, a dict, a
run.yaml path, a model id (defaults around it) – and keyword sections on top."""

from __future__ import annotations

import json
from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from typing import Any

from moetune.config import RunConfig, parse_config
from moetune.errors import ConfigError, clip
from moetune.lint.preflight import resolve_run

ConfigLike = RunConfig | Mapping[str, Any] | str | Path | None


def run_config(config: ConfigLike = None, /, **sections: Any) -> RunConfig:
    """A RunConfig from `config` with `sections` over it, each a run.yaml section as a dict
    (`lora={"rank": 8}`); `model` may also be a model id (`model="Qwen/Qwen3-30B-A3B"`).
    Overrides go through the same `--set` path as the CLI, so a bad value is refused alike."""
    leaves = _leaves(_sections(sections))
    sets = [f"{key}={json.dumps(value, default=str)}" for key, value in leaves]
    if isinstance(config, RunConfig):
        return parse_config(config.model_dump(), sets) if sets else config
    if isinstance(config, Mapping):
        return parse_config(dict(config), sets)
    if config is not None:
        config = path_arg(config, "config", "a run.yaml path, a dict or a RunConfig")
    if config is None:
        if "model.id" not in {key for key, _ in leaves}:
            raise ConfigError(
                "no configuration: neither a run.yaml, a dict nor model= was given",
                'pass a run.yaml path, a dict, or model="<dir or hub id>"',
            )
        return parse_config({}, sets)
    return resolve_run(str(config), sets)  # a run.yaml, or defaults around a model id


def _sections(sections: dict[str, Any]) -> dict[str, Any]:
    """`model="id"` is `model={"id": "id"}`; every other section must be a dict."""
    out: dict[str, Any] = {}
    for name, value in sections.items():
        if name == "model" and isinstance(value, str | Path):
            value = {"id": str(path_arg(value, "model", "a model dir or hub id"))}
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"{name}={value!r} is not a section of run.yaml (a dict of its fields)",
                f'pass {name}={{"field": value}} (see `moetune schema` for the fields)',
            )
        out[name] = dict(value)
    return out


def path_arg(value: Any, name: str, what: str) -> Path:
    """`value` as a Path, refused (a ConfigError, not a TypeError deep inside) where it is
    not a non-empty str or path: a number or bytes would otherwise be read as a model id."""
    if isinstance(value, str | PathLike) and str(value).strip():
        return Path(value)
    shown = repr(value) if isinstance(value, str) else f"a {type(value).__name__}"
    raise ConfigError(f"{name}={clip(shown, 80)} is not {what}", f"pass {name} as {what}")


def _leaves(tree: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) for every leaf; a dict inside a section is walked, a list is one
    value (lists replace, as `--set` does)."""
    out: list[tuple[str, Any]] = []
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out += _leaves(value, f"{dotted}.")
        else:
            out.append((dotted, value))
    return out
