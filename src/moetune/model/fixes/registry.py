"""Per-model_type workarounds for transformers bugs that stop a loaded model from training.

A fix is registered under the checkpoint's top-level `model_type` (config.json's, e.g.
`llama4` for `Llama4ForConditionalGeneration`, not its `llama4_text` language model) and
changes the loaded instance only – a subclass swapped in with the same class name and
state dict, a missing config field filled – so the adapter's keys, a reload with plain
`PeftModel.from_pretrained` and a merged export are as without it. Each fix's docstring
names the bug it works around, and a probe test checks the bug is still in the installed
transformers (a fixed release is noticed and the fix removed).

`apply_fixes` runs where moetune loads a checkpoint for training or scoring
(train.model.load_model). This module imports none of the fixes: importing moetune.model
registers them (llama4.py, omni.py, step3p7.py, imported by model/fixes/__init__.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moetune.errors import UnknownFamilyError
from moetune.registry import Registry

ModelFix = Callable[[Any], int]  # loaded transformers model -> how many objects it changed
MODEL_FIXES: Registry[ModelFix] = Registry("model fix", UnknownFamilyError)


def register_fix(model_type: str) -> Callable[[ModelFix], ModelFix]:
    """Register the fix for checkpoints whose config.json says `model_type`."""
    return MODEL_FIXES.register(model_type)


def apply_fixes(model: Any) -> int:
    """Apply the fix registered for `model`'s type (a PeftModel or the transformers model
    under it); how many objects it changed (0: none registered, or already fixed)."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    model_type = getattr(getattr(base, "config", None), "model_type", "")
    return MODEL_FIXES.get(model_type)(base) if model_type in MODEL_FIXES else 0


def same_name_subclass(cls: type, body: dict[str, Any], flag: str) -> type:
    """`cls` with `body` replacing its methods, under the same name and module (transformers
    writes the name into config.json's `architectures` and reads the module's source for
    what the class supports); `cls` itself when already swapped."""
    if getattr(cls, flag, False):
        return cls
    if cls not in _SUBCLASSES:  # one per class: every instance of it gets the same type
        names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        _SUBCLASSES[cls] = type(cls.__name__, (cls,), {**body, **names, flag: True})
    return _SUBCLASSES[cls]


_SUBCLASSES: dict[type, type] = {}
