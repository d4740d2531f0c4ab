"""The embedded default: a tiny Qwen3-MoE base pretrained on synthetic skills.

`load_base()` returns the shipped base (no network, no cache); `skills` defines the
tasks, `evaluate` scores them by greedy exact match, `base` rebuilds the base. Names
resolve lazily so `import moetune.demo` stays cheap (torch and transformers load on use).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moetune.demo.base import build_base, cache_dir, load_base, load_meta
    from moetune.demo.evaluate import exact_match, skill_scores
    from moetune.demo.skills import SKILLS, Item, Skill, base_skills, make_items, new_skills
    from moetune.demo.tokenizer import build_tokenizer, load_tokenizer

_WHERE = {
    "base": ("build_base", "cache_dir", "load_base", "load_meta"),
    "evaluate": ("exact_match", "skill_scores"),
    "skills": ("SKILLS", "Item", "Skill", "base_skills", "make_items", "new_skills"),
    "tokenizer": ("build_tokenizer", "load_tokenizer"),
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}
__all__ = [
    "SKILLS",
    "Item",
    "Skill",
    "base_skills",
    "build_base",
    "build_tokenizer",
    "cache_dir",
    "exact_match",
    "load_base",
    "load_meta",
    "load_tokenizer",
    "make_items",
    "new_skills",
    "skill_scores",
]


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'moetune.demo' has no attribute {name!r}")
    return getattr(importlib.import_module(f"moetune.demo.{_MODULE_OF[name]}"), name)
