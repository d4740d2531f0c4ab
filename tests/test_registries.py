"""Every plug-in kind is a moetune.registry.Registry: an unknown name is a user error that
lists the known ones, and a registry module imports none of its plug-ins (the package's
`__init__` does)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from moetune.config import RewardArgs, RungArgs
from moetune.data.rungs import RUNG_ROWS
from moetune.engine.forwards import ENGINE_OVERRIDES
from moetune.engine.quant.stacks import QUANTIZERS
from moetune.errors import MoetuneError
from moetune.evaluate import RUNG_KINDS, make_rung
from moetune.export import load_formats
from moetune.lint import RULES
from moetune.model import OVERRIDES
from moetune.model.fixes.registry import MODEL_FIXES
from moetune.recipe import STACKS
from moetune.registry import Registry
from moetune.train.grpo.replay import GATES
from moetune.train.grpo.rewards import REWARDS, build_reward
from moetune.train.methods import METHODS
from test_layering import edges

REGISTRIES: dict[str, tuple[Registry[Any], set[str]]] = {
    "lint rules": (RULES, {"MOE-LORA-DROPOUT", "MLX-NO-BACKEND"}),
    "rung kinds": (RUNG_KINDS, {"loss", "exact_match", "contains", "multiple_choice", "lm_eval"}),
    "rung rows": (RUNG_ROWS, {"loss", "exact_match", "contains", "multiple_choice", "lm_eval"}),
    "engine overrides": (ENGINE_OVERRIDES, {"dbrx"}),
    "quantizers": (QUANTIZERS, {"int8", "nf4"}),
    "model overrides": (OVERRIDES, {"qwen3_moe", "mixtral"}),
    "model fixes": (MODEL_FIXES, {"llama4", "qwen3_omni_moe_thinker"}),
    "export formats": (load_formats(), {"merged", "vllm", "gguf", "mlx"}),
    "train methods": (METHODS, {"sft", "dpo", "grpo"}),
    "rewards": (REWARDS, {"exact_match", "regex", "length"}),
    "recipe stacks": (STACKS, {"peft", "mlx"}),
    "router gate rules": (GATES, {"Qwen3MoeTopKRouter", "DeepseekV3TopkRouter"}),
}


@pytest.mark.parametrize("kind", sorted(REGISTRIES))
def test_each_registry_holds_its_plug_ins_and_names_them_on_a_miss(kind: str) -> None:
    registry, expected = REGISTRIES[kind]
    assert isinstance(registry, Registry)
    assert expected <= set(registry.names())
    with pytest.raises(MoetuneError) as err:
        registry.get("no-such-entry")
    assert all(name in err.value.fix for name in expected)


LOOKUPS: list[tuple[Callable[[], Any], str]] = [
    (lambda: make_rung(RungArgs(name="r", kind="nope", data="x.jsonl")), "lm_eval"),
    (lambda: build_reward(RewardArgs(name="nope")), "exact_match"),
]


@pytest.mark.parametrize(("lookup", "named"), LOOKUPS)
def test_the_public_lookups_keep_their_own_messages(lookup: Callable[[], Any], named: str) -> None:
    with pytest.raises(MoetuneError) as err:
        lookup()
    assert "unknown" in err.value.cause and named in err.value.fix


# registry module -> the modules holding its plug-ins (imported by the package instead)
RULE_MODULES = ("dist", "infra", "ladder", "mlx", "peft", "serve")
PLUG_INS = {
    "moetune.lint.registry": [f"moetune.lint.rules.{s}" for s in RULE_MODULES],
    "moetune.evaluate.rungs": ["moetune.evaluate.lmeval"],
    "moetune.engine.forwards": ["moetune.engine.forwards_dbrx"],
    "moetune.model.families.registry": ["moetune.model.families.overrides"],
    "moetune.model.fixes.registry": ["moetune.model.fixes.llama4", "moetune.model.fixes.omni"],
    "moetune.export.registry": ["moetune.export." + s for s in ("merged", "vllm", "gguf", "mlx")],
}  # fmt: skip
# the face that imports a registry's plug-ins, where it is not the registry's own package
FACES = {"moetune.lint.registry": "moetune.lint.rules"}


@pytest.mark.parametrize("registry", sorted(PLUG_INS))
def test_a_registry_module_imports_none_of_its_plug_ins(registry: str) -> None:
    assert edges(registry) & set(PLUG_INS[registry]) == set()
    package = FACES.get(registry, registry.rpartition(".")[0])
    held = {p for p in PLUG_INS[registry] if p in edges(package)}
    assert held or registry == "moetune.export.registry"  # export: load_formats imports them
