"""Keys that agree: each keyed choice field's values – read off the config model's annotation
with typing.get_args, never written out here – are the names of every registry that serves
the field and the values its docs list. A value added on one side only fails (shown once,
generically, by the last tests).

Plug-in kinds with no Literal on purpose (rung kinds, rewards, export formats, serving
engines, router gate rules: a plug-in registers its name) take their registry as the
source, and what the config's description, the CLI's help and the docs list must match it.
Where a place names only some values, `expect` says which, derived from the field (its
default, a trait) rather than listed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import pytest
from pydantic import BaseModel

from moetune.cli.export import export_cmd
from moetune.cli.serve import serve_plan
from moetune.config import (
    TUNING_KINDS,
    LoraArgs,
    ModelArgs,
    OutputArgs,
    RewardArgs,
    RunConfig,
    RungArgs,
    SourceArgs,
    TrainArgs,
)
from moetune.config.keys import (
    LORA_ENGINES,
    LORA_STACKS,
    OFFLOAD_MODES,
    OffloadMode,
    streaming_modes,
)
from moetune.config.lane import LaneArgs
from moetune.data.convert import BECOMES, CONVERTERS
from moetune.demo.quickstart import DEMOS
from moetune.engine.offload.store import Mode
from moetune.engine.quant.stacks import QUANTIZERS
from moetune.engine.resolve import Engine
from moetune.evaluate import RUNG_KINDS
from moetune.export import load_formats
from moetune.lane.providers import PROVIDERS, provider_class, provider_names
from moetune.plan import step
from moetune.plan.devices import sharding
from moetune.plan.methods import METHOD_TERMS
from moetune.plan.moves import LEVEL, STORAGES
from moetune.plan.serve import engines as serving
from moetune.recipe import STACKS as RECIPE_STACKS
from moetune.train import launch, offload, stacks
from moetune.train.grpo.replay import GATES
from moetune.train.grpo.rewards import REWARDS
from moetune.train.methods import METHODS
from moetune.train.routing.select import SCORERS
from moetune.train.trackers import TRACKERS

ROOT = Path(__file__).resolve().parent.parent
Names = Callable[[], set[str]]


def every(values: set[str]) -> set[str]:
    return values


# ---------------------------------------------------------------- where values are read


def config_values(model: type[BaseModel], name: str) -> set[str]:
    """A Literal field's values (a list field's item values), off its annotation."""
    annotation = model.model_fields[name].annotation
    if get_origin(annotation) is list:
        (annotation,) = get_args(annotation)
    assert get_origin(annotation) is Literal, f"{model.__name__}.{name} is not a Literal"
    return {str(v) for v in get_args(annotation)}


def literal(model: type[BaseModel], name: str) -> Names:
    return lambda: config_values(model, name)


def but_default(model: type[BaseModel], name: str) -> Callable[[set[str]], set[str]]:
    """The values other than the field's default: those a registry entry implements (the
    default is the plain way: bf16 experts as model.dtype, no selection, formats by keys)."""
    return lambda values: values - {model.model_fields[name].default}


def words(body: str) -> set[str]:
    """`a | b | c`, `[a, b, c]` or `a, b, c` as its values."""
    return {w.strip(" \n[]`\\") for w in re.split(r"\\?\||,", body)} - {""}


@cache
def text(page: str) -> str:
    return (ROOT / page).read_text()


def listed(page: str, pattern: str) -> Names:
    """The values every match of `pattern` on `page` lists (its group 1), together."""
    return lambda: {w for body in re.findall(pattern, text(page)) for w in words(body)}


def field_listed(page: str, field: str) -> Names:
    """`field: a | b` or `field: [a, b]` in code on `page` (a lone `field: a` names one)."""
    return listed(page, rf"`{re.escape(field)}: ([^`]*[|\[][^`]*)`")


def flag_listed(page: str, flag: str) -> Names:
    """`--flag a|b|c` on `page`."""
    return listed(page, rf"{re.escape(flag)}\s+([\w.-]+(?:\|[\w.-]+)+)")


def table_listed(page: str, header: str) -> Names:
    """The code in the first cell of each row of the first table headed `| header |`."""

    def names() -> set[str]:
        start = re.search(rf"^\| {re.escape(header)} \|.*\n\|[-| ]+\|\n", text(page), re.M)
        assert start, f"{page}: no table headed {header!r}"
        rows = re.match(r"(?:\|.*\n)*", text(page)[start.end() :])
        assert rows
        return {re.findall(r"`([^`]+)`", row)[0] for row in rows.group(0).splitlines()}

    return names


def described(model: type[BaseModel], name: str, pattern: str) -> Names:
    """The values a str field's description lists (group 1 of `pattern`)."""
    return lambda: words(re.search(pattern, model.model_fields[name].description or "")[1])


def help_listed(command: Callable[..., Any], parameter: str) -> Names:
    """The values a CLI option's help lists (`a | b | c.`)."""

    def names() -> set[str]:
        option = get_type_hints(command, include_extras=True)[parameter].__metadata__[0]
        return words(option.help.rstrip("."))

    return names


def replay_routers() -> set[str]:
    """The router classes tests/test_train_replay.py checks a gate rule on."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from test_train_replay import FAMILIES, family_config

    found = set()
    for variant in FAMILIES:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**family_config(variant)))
        found |= {type(m).__name__ for m in model.modules() if "Router" in type(m).__name__}
    return found


# ---------------------------------------------------------------- the keys


@dataclass(frozen=True)
class Place:
    """One place that enumerates a key's values; `expect` says which of them it names."""

    label: str
    names: Names
    expect: Callable[[set[str]], set[str]] = every


@dataclass(frozen=True)
class Key:
    name: str
    values: Names  # the source: the config's Literal, or a plug-in registry
    places: tuple[Place, ...]


def _providers() -> set[str]:
    """PROVIDERS once every provider module has registered itself (each loads when used)."""
    for name in provider_names():
        provider_class(name)
    return set(PROVIDERS)


def _quantisers() -> set[str]:
    return {q.method for _, q in QUANTIZERS.items() if not q.stored}  # published: not a choice


KEYS = (
    Key("train.method", literal(TrainArgs, "method"), (
        Place("plan/methods.py METHOD_TERMS", lambda: set(METHOD_TERMS)),
        Place("train/methods.py METHODS", lambda: set(METHODS)),
        Place("demo/quickstart.py DEMOS", lambda: set(DEMOS)),
        Place("docs/train.md", field_listed("docs/train.md", "train.method")),
    )),
    Key("train.tuning", literal(TrainArgs, "tuning"), (
        Place("config TUNING_KINDS", lambda: set(TUNING_KINDS)),
        Place("plan/step.py Method", lambda: set(get_args(step.Method))),
        Place("docs/train.md", field_listed("docs/train.md", "train.tuning")),
    )),
    Key("train.strategy", literal(TrainArgs, "strategy"), (
        Place("plan/devices/sharding.py STRATEGIES", lambda: set(sharding.STRATEGIES)),
        Place("train/launch.py STRATEGIES", lambda: set(launch.STRATEGIES)),
        Place("docs/train.md", flag_listed("docs/train.md", "--strategy")),
        Place("docs/plan.md", flag_listed("docs/plan.md", "--strategy")),
        Place("README.md (the sharding ones)", flag_listed("README.md", "--strategy"),
              lambda v: {n for n, s in sharding.STRATEGIES.items() if s.sharded and n in v}),
    )),
    Key("train.offload", literal(TrainArgs, "offload"), (
        Place("config/keys.py OFFLOAD_MODES", lambda: set(OFFLOAD_MODES)),
        Place("engine/offload/store.py Mode", lambda: set(get_args(Mode)),
              lambda v: set(streaming_modes())),
        Place("docs/train.md", field_listed("docs/train.md", "train.offload")),
        Place("docs/plan.md --offload", flag_listed("docs/plan.md", "--offload"),
              lambda v: set(streaming_modes())),
        Place("README.md --offload", flag_listed("README.md", "--offload"),
              lambda v: set(streaming_modes())),
    )),
    Key("lora.stack", literal(LoraArgs, "stack"), (
        Place("config/keys.py LORA_STACKS", lambda: set(LORA_STACKS)),
        Place("recipe STACKS", lambda: set(RECIPE_STACKS)),
        Place("train/stacks.py STACKS", lambda: set(stacks.STACKS)),
        Place("docs/recipe.md", flag_listed("docs/recipe.md", "--stack")),
    )),
    Key("lora.engine", literal(LoraArgs, "engine"), (
        Place("config/keys.py LORA_ENGINES", lambda: set(LORA_ENGINES)),
        Place("engine/resolve.py Engine (resolved)", lambda: set(get_args(Engine)),
              lambda v: {n for n, e in LORA_ENGINES.items() if e.split is not None and n in v}),
        Place("docs/engine.md", table_listed("docs/engine.md", "value")),
    )),
    Key("model.experts_dtype", literal(ModelArgs, "experts_dtype"), (
        Place("engine/quant QUANTIZERS", _quantisers, but_default(ModelArgs, "experts_dtype")),
        Place("plan/moves.py LEVEL", lambda: set(LEVEL)),
        Place("plan/moves.py STORAGES", lambda: {s.dtype for s in STORAGES},
              but_default(ModelArgs, "experts_dtype")),
        Place("train/offload.py _SPILL_RATIO", lambda: set(offload._SPILL_RATIO),
              but_default(ModelArgs, "experts_dtype")),
        Place("docs/engine.md", field_listed("docs/engine.md", "model.experts_dtype"),
              but_default(ModelArgs, "experts_dtype")),
    )),
    Key("lora.expert_selection", literal(LoraArgs, "expert_selection"), (
        Place("train/routing/select.py SCORERS", lambda: set(SCORERS),
              but_default(LoraArgs, "expert_selection")),
        Place("docs/engine.md", field_listed("docs/engine.md", "lora.expert_selection"),
              but_default(LoraArgs, "expert_selection")),
    )),
    Key("data.sources[].format", literal(SourceArgs, "format"), (
        Place("data/convert.py CONVERTERS", lambda: set(CONVERTERS),
              but_default(SourceArgs, "format")),
        Place("data/convert.py BECOMES", lambda: set(BECOMES), but_default(SourceArgs, "format")),
        Place("docs/data.md", field_listed("docs/data.md", "format")),
    )),
    Key("output.report_to", literal(OutputArgs, "report_to"), (
        Place("train/trackers.py TRACKERS", lambda: set(TRACKERS)),
        Place("docs/train.md", field_listed("docs/train.md", "output.report_to")),
    )),
    Key("output.serve_with", literal(OutputArgs, "serve_with"), (
        Place("docs/export.md", field_listed("docs/export.md", "output.serve_with")),
        # serve-plan sizes only engines a run can name; peft (unmerged) it does not plan
        Place("plan/serve ENGINES", lambda: set(serving.ENGINES),
              lambda v: v & set(serving.ENGINES)),
    )),
    Key("lane.provider", literal(LaneArgs, "provider"), (
        Place("lane/providers PROVIDERS", _providers),
        Place("docs/lane.md table", table_listed("docs/lane.md", "provider")),
        Place("docs/lane.md --provider", flag_listed("docs/lane.md", "--provider")),
        Place("README.md --provider", flag_listed("README.md", "--provider")),
    )),
    Key("export --format", lambda: set(load_formats()), (
        Place("cli/export.py --format help", help_listed(export_cmd, "fmt")),
        Place("docs/export.md", flag_listed("docs/export.md", "--format")),
        Place("README.md", flag_listed("README.md", "--format")),
    )),
    Key("serve-plan --engine", lambda: set(serving.ENGINES), (
        Place("cli/serve.py --engine help", help_listed(serve_plan, "engine")),
        Place("docs/export.md", flag_listed("docs/export.md", "--engine")),
    )),
    Key("eval.rungs[].kind", lambda: set(RUNG_KINDS), (
        Place("RungArgs.kind description", described(RungArgs, "kind", r"kind: (.*)\.$")),
        Place("docs/evaluate.md", table_listed("docs/evaluate.md", "kind")),
    )),
    Key("train.grpo.rewards[].name", lambda: set(REWARDS), (
        Place("RewardArgs.name description", described(RewardArgs, "name", r"^(.*?), or")),
        Place("RewardArgs docstring",
              lambda: words(re.search(r"name \((.*?)\)", RewardArgs.__doc__ or "")[1])),
        Place("docs/train.md", field_listed("docs/train.md", "name")),
    )),
    Key("router gate rules", lambda: set(GATES), (
        Place("tests/test_train_replay.py routers", replay_routers),
    )),
)  # fmt: skip


def disagreements(key: Key) -> list[str]:
    """Each place whose names are not the ones it should name, saying both."""
    values, out = key.values(), []
    for place in key.places:
        names, want = place.names(), place.expect(values)
        if names != want:
            out.append(f"{place.label}: {sorted(names)}, {key.name}: {sorted(want)}")
    return out


@pytest.mark.parametrize("key", KEYS, ids=lambda k: k.name)
def test_every_place_names_the_keys_values(key: Key) -> None:
    assert key.values(), f"{key.name}: no values read"
    assert disagreements(key) == []


# ---------------------------------------------------------------- every docs listing


def _literal_fields(model: type[BaseModel], prefix: str = "") -> dict[str, set[str]]:
    """`section.field` -> values, for every Literal field of the run config."""
    out: dict[str, set[str]] = {}
    for name, info in model.model_fields.items():
        inner = info.annotation
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            out |= _literal_fields(inner, f"{prefix}{name}.")
        elif get_origin(inner) is Literal or (
            get_origin(inner) is list and get_origin(get_args(inner)[0]) is Literal
        ):
            out[f"{prefix}{name}"] = config_values(model, name)
    return out


PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("docs/**/*.md"))]


@pytest.mark.parametrize("page", PAGES)
def test_every_field_listing_in_the_docs_names_only_values_it_takes(page: str) -> None:
    fields = _literal_fields(RunConfig)
    wrong = {
        field: sorted(listed - values)
        for field, values in fields.items()
        if (listed := field_listed(page, field)()) - values
    }
    assert wrong == {}


# ---------------------------------------------------------------- the checks can fail


@pytest.mark.parametrize("key", KEYS, ids=lambda k: k.name)
def test_a_name_on_one_side_only_is_a_disagreement(key: Key) -> None:
    extra = "one-side-only"
    for i, place in enumerate(key.places):
        widened = replace(place, names=lambda p=place: p.names() | {extra})
        broken = replace(key, places=(*key.places[:i], widened, *key.places[i + 1 :]))
        assert [d for d in disagreements(broken) if d.startswith(place.label)]
    grown = replace(key, values=lambda: key.values() | {extra})
    assert len(disagreements(grown)) >= 1


def test_a_registry_gaining_a_value_alone_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real registry, patched: an offload mode registered without its Literal."""
    monkeypatch.setattr(OFFLOAD_MODES, "_entries", dict(OFFLOAD_MODES._entries))
    OFFLOAD_MODES.add("nvme", OffloadMode(streams=True, on_disk=True, where="an NVMe"))
    (key,) = [k for k in KEYS if k.name == "train.offload"]
    assert disagreements(key)[0].startswith("config/keys.py OFFLOAD_MODES: ['cpu', 'disk',")
