"""Checkpoints whose modeling code ships with them: config.json's `auto_map` names Python
files beside the weights (DeepSeek-MoE 16B's `modeling_deepseek.py`, Kimi-K2's DeepSeek-V3
file) for a model_type transformers does not ship.

That code runs with the user's rights, so it runs only when asked (`model.trust_remote_code`,
`--trust-remote-code`): its config and causal-LM classes are imported through transformers'
own dynamic-module loader and registered in transformers' auto mappings for this process.
From then on every stage – the meta build, the counts, the recipe, the plan, the trainer's
`from_pretrained` – finds them like a built-in family (docs/knowledge.md §6b).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moetune.errors import UnknownFamilyError, clip

# the auto classes moetune builds from: the config and the causal LM
AUTO_CLASSES = ("AutoConfig", "AutoModelForCausalLM")
_TRUSTED: set[str] = set()  # sources whose code this process was told to run


class RemoteCodeError(UnknownFamilyError):
    """A checkpoint's own modeling code is needed and was not trusted, or does not load."""


def auto_map(raw: dict[str, Any]) -> dict[str, str]:
    """config.json's `auto_map`: auto class -> `module.Class` (a `repo--` prefix kept)."""
    found = raw.get("auto_map")
    if not isinstance(found, dict):
        return {}
    return {k: v for k, v in found.items() if isinstance(v, str)}  # tokenizers: pairs


def code_files(raw: dict[str, Any]) -> list[str]:
    """The Python files `auto_map` names (configuration_x.py, modeling_x.py), in order."""
    modules = (ref.rpartition("--")[2].rpartition(".")[0] for ref in auto_map(raw).values())
    return list(dict.fromkeys(f"{m}.py" for m in modules if m))


def needs_remote_code(raw: dict[str, Any]) -> bool:
    """config.json names its own classes for a model_type the installed transformers lacks."""
    # lazy: heavy to import (transformers)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return bool(auto_map(raw)) and str(raw.get("model_type") or "") not in CONFIG_MAPPING_NAMES


def refused(name: str, raw: dict[str, Any]) -> RemoteCodeError:
    """The one-line refusal of a remote-code checkpoint without the flag."""
    # lazy: heavy to import (transformers)
    import transformers

    files = ", ".join(code_files(raw)) or "its auto_map"
    return RemoteCodeError(
        f"{clip(name, 120)}: transformers {transformers.__version__} does not ship model_type "
        f"{raw.get('model_type')!r}; its modeling code comes with the checkpoint ({files})",
        "pass --trust-remote-code (model.trust_remote_code: true) to run those files – they "
        "run as Python with your user's rights, so read them first",
    )


def prepare(name: str, raw: dict[str, Any], trust: bool) -> None:
    """Make a remote-code checkpoint buildable: its classes registered when `trust`, a
    RemoteCodeError when not. Checkpoints transformers ships are left alone."""
    if not needs_remote_code(raw):
        return
    source = _source(name)
    if not trust and source not in _TRUSTED:
        raise refused(name, raw)
    register_remote_classes(source, raw)
    _TRUSTED.add(source)


def _source(name: str) -> str:
    path = Path(name).expanduser()
    return str(path.resolve()) if path.is_dir() else name


def register_remote_classes(source: str, raw: dict[str, Any]) -> tuple[type, type]:
    """Import the config and causal-LM classes `auto_map` names from `source` (a local dir,
    or a hub id whose files transformers fetches) and register them with transformers."""
    # lazy: heavy to import (transformers)
    from transformers import AutoConfig, AutoModelForCausalLM

    refs = auto_map(raw)
    missing = [k for k in AUTO_CLASSES if k not in refs]
    if missing:
        raise RemoteCodeError(
            f"{clip(source, 120)}: config.json's auto_map names no {missing[0]}",
            "add the class its modeling file defines to auto_map, e.g. "
            '"AutoModelForCausalLM": "modeling_x.XForCausalLM"',
        )
    config_cls = _import(refs["AutoConfig"], source)
    model_cls = _import(refs["AutoModelForCausalLM"], source)
    try:
        AutoConfig.register(str(raw["model_type"]), config_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)
    except ValueError as exc:  # model_type / config_class disagree between the files
        raise RemoteCodeError(
            f"{clip(source, 120)}: its classes do not fit together ({clip(exc, 160)})",
            "make config.json's model_type and the classes' model_type / config_class agree",
        ) from None
    return config_cls, model_cls


def _import(ref: str, source: str) -> type:
    # lazy: heavy to import (transformers)
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    try:
        found: type = get_class_from_dynamic_module(ref, source)
    except Exception as exc:  # the checkpoint's own code may raise anything at import
        raise RemoteCodeError(
            f"{clip(source, 120)}: cannot import {ref} ({type(exc).__name__}: {clip(exc, 160)})",
            "check that the file sits beside config.json and imports with the installed "
            "transformers",
        ) from None
    return found
