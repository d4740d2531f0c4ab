"""Loading the run config: YAML + `--set section.field=value` overrides (CLI beats YAML
beats defaults), the resolved copy written beside a run, and the field documentation."""

from __future__ import annotations

import copy
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from moetune.config.fields import comma_list, lists_values
from moetune.config.paths import rebase
from moetune.config.sections import RunConfig
from moetune.errors import ConfigError, clip, os_problem
from moetune.io import REDACTED, masked, register_secrets
from moetune.ledger import public_env


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping states one key twice: YAML would keep the last silently."""


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping with a key stated twice (line and key named)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` may restate keys: that is what it is for
            key = self.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
            line = key_node.start_mark.line + 1
            if not isinstance(key, Hashable):
                break  # SafeLoader refuses it itself, with its own message
            if key in seen:
                raise DuplicateKeyError(
                    problem=f"duplicate key {key!r} at line {line} (first at line {seen[key]})"
                )
            seen[key] = line
        return super().construct_mapping(node, deep)


class YamlLimitError(yaml.YAMLError):
    """A document a run config never is: nested past the parser's stack, or aliases that
    expand to more nodes than memory holds (a "billion laughs" file hangs, never fails)."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(problem)
        self.fix = fix


MAX_NODES = 1_000_000  # expanded; a run config has a few hundred


def _expanded(node: yaml.Node, memo: dict[int, int]) -> int:
    """How many nodes `node` stands for once every alias is expanded (memoised: linear)."""
    if id(node) not in memo:
        memo[id(node)] = 1  # a recursive alias counts once
        if isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        else:
            children = node.value if isinstance(node, yaml.SequenceNode) else []
        memo[id(node)] = 1 + sum(_expanded(child, memo) for child in children)
    return memo[id(node)]


def load_yaml(text: str) -> Any:
    """`yaml.safe_load` that refuses duplicate keys, alias bombs and nesting past the
    parser's stack: every YAML moetune reads goes through it."""
    loader = UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()  # type: ignore[no-untyped-call]
        if node is not None and _expanded(node, {}) > MAX_NODES:
            fix = "write the values out instead of nesting aliases (&name / *name)"
            raise YamlLimitError(f"its aliases expand to more than {MAX_NODES:,} values", fix)
        return None if node is None else loader.construct_document(node)  # type: ignore[no-untyped-call]
    except RecursionError:
        raise YamlLimitError("nested too deeply to parse", "flatten the nesting") from None
    finally:
        loader.dispose()  # type: ignore[no-untyped-call]


def _apply_override(data: dict[str, Any], assignment: str) -> None:
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise ConfigError(f"bad override {assignment!r}", "write --set section.field=value")
    _refuse_control_characters(key, raw)
    node = data
    *parents, leaf = key.strip().split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key!r} goes through a non-section", "check the path")
    try:
        node[leaf] = _value(key.strip(), raw)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(
            f"--set {clip(key, 60)}: the value {clip(raw, 60)!r} is not valid YAML ({problem})",
            "close brackets and quotes, e.g. --set lora.targets=[attention,experts]",
        ) from None


def _refuse_control_characters(key: str, raw: str) -> None:
    """A newline (or another control character) in a --set value is a paste gone wrong:
    YAML would fold it into a space or read a second key from it, so the run would get a
    value nobody typed. The value itself is not shown: it may be a secret (lane.env)."""
    bad = next((c for c in key + raw if (ord(c) < 32 and c != "\t") or ord(c) == 127), None)
    if bad is not None:
        name = clip(key.strip(), 60)
        raise ConfigError(
            f"--set {repr(name) if bad in key else name}: the value holds a control character "
            f"({bad!r}: a line break pasted in?)",
            "pass the value on one line, e.g. --set section.field=value",
        )


def _value(path: str, raw: str) -> Any:
    """The YAML value of `raw`; for a list field an unquoted `a,b` is the list [a, b], as
    its shortcut flag reads it, and a quoted one is one item (a command may hold commas)."""
    value = load_yaml(raw)
    if not isinstance(value, str) or not lists_values(path):
        return value
    return [value] if raw.strip()[:1] in ("'", '"') else comma_list(value)


# Fixes that say more than "set it to a valid value", by the field an error names.
FIXES = {"lane.env": 'quote every value (NAME: "…"): env values are text, secrets above all'}
# Fields that were renamed: an old name is refused with the new one, never read silently.
RENAMED = {"lora.experts_rank": "lora.expert_rank"}


ENV_LOC = ("lane", "env")  # every value under it may be a secret, whatever YAML made of it


def _shown(loc: tuple[Any, ...], value: Any) -> Any:
    """The input an error names, with lane.env masked whole wherever it sits in it."""
    loc = tuple(str(p) for p in loc)
    if loc[: len(ENV_LOC)] == ENV_LOC:
        return REDACTED
    rest = ENV_LOC[len(loc) :] if ENV_LOC[: len(loc)] == loc else ()
    if not rest or not isinstance(value, dict):
        return masked(value)
    return masked({k: _shown((*loc, k), v) for k, v in value.items()})


def _raw_env_secrets(data: dict[str, Any]) -> list[str]:
    """lane.env's values as given (numbers, bools and lists included, as text), before any
    validation: an error about any field must not show them."""
    lane = data.get("lane")
    env = lane.get("env") if isinstance(lane, dict) else None
    if not isinstance(env, dict):
        return []
    public = lane.get("public_env")  # type: ignore[union-attr]
    public = set(public) if isinstance(public, list) and all(
        isinstance(p, str) for p in public) else set()  # fmt: skip
    return [str(leaf) for k, v in env.items() if k not in public for leaf in _leaves(v)]


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, list | tuple):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def _describe(err: ValidationError) -> tuple[str, str]:
    """(`field: what a valid value is (got what was given)`, the fix) for the first error."""
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    schema = "`moetune schema` lists every field and its meaning"
    if first["type"] == "extra_forbidden" and where in RENAMED:
        new = RENAMED[where]
        return f"{where} was renamed {new}", f"write {new}: {first.get('input')} instead"
    if first["type"] == "extra_forbidden":
        return f"unknown key {where!r} in run config", f"check the spelling; {schema}"
    msg = first["msg"].removeprefix("Value error, ")
    valid = msg.removeprefix("must be ")
    fix = f"set {where} to {valid}" if valid != msg else FIXES.get(where, "set it to a valid value")
    return f"{where}: {msg} (got {_shown(first['loc'], first.get('input'))})", f"{fix}; {schema}"


def parse_config(data: dict[str, Any], overrides: list[str] | None = None) -> RunConfig:
    """Validate a config dict (plus overrides) into a RunConfig, or raise ConfigError."""
    data = copy.deepcopy(data)  # overrides must not leak into the caller's dicts
    for assignment in overrides or []:
        _apply_override(data, assignment)
    register_secrets(_raw_env_secrets(data))
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(*_describe(err)) from None
    register_secrets(lane_secrets(cfg))  # masked from here on, by every writer and console
    return cfg


def lane_secrets(cfg: RunConfig) -> list[str]:
    """The run's secret values: every lane.env value whose name is not in lane.public_env."""
    return [v for k, v in cfg.lane.env.items() if k not in set(cfg.lane.public_env)]


def read_config_text(path: Path) -> str:
    """The run config's text; a missing, unreadable or binary file is a ConfigError."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{clip(path, 80)} is not UTF-8 text (byte {err.start} cannot be decoded)",
            "a run config is a YAML text file saved as UTF-8 (see configs/ for examples)",
        ) from None
    except OSError as err:
        cause = f"run config {clip(path, 80)}: {os_problem(err)}"
        raise ConfigError(cause, "pass the path of a readable run.yaml") from None


def load_config(path: Path | str, overrides: list[str] | None = None) -> RunConfig:
    """Read a run.yaml; errors name the file and the field."""
    path = Path(path)
    try:
        data = load_yaml(read_config_text(path))
    except yaml.YAMLError as err:
        first = f"{clip(path, 80)} is not valid YAML: {err}".splitlines()[0]
        fix = "keep one of the two" if isinstance(err, DuplicateKeyError) else "fix the YAML syntax"
        fix = err.fix if isinstance(err, YamlLimitError) else fix
        raise ConfigError(first, fix) from None
    if data is None:  # an empty file is a mistake (a truncated copy), never "all defaults"
        raise ConfigError(
            f"{clip(path, 80)} is empty", "write at least model.id (see configs/ for examples)"
        )
    if not isinstance(data, dict):
        cause = f"{clip(path, 80)} must hold a mapping of sections"
        raise ConfigError(cause, "see configs/ for examples")
    saved = is_run_config(path)  # rebased first: a --set output.dir=NEW then wins over it
    try:
        cfg = parse_config(data, None if saved else overrides)
        if saved:
            cfg = rebase(cfg, path.parent)
            cfg = parse_config(cfg.model_dump(mode="json"), overrides) if overrides else cfg
    except ConfigError as err:
        raise ConfigError(f"{clip(path, 80)}: {err.cause}", err.fix) from None
    if not _names_model(data, overrides or []):
        raise ConfigError(
            f"{clip(path, 80)} has no model.id, so the run would target the schema's default "
            f"{cfg.model.id}",
            "add `model: {id: <your model dir or hub id>}` (or pass --set model.id=...)",
        )
    return cfg


def _names_model(data: dict[str, Any], overrides: list[str]) -> bool:
    """Whether a run file (or an override) names model.id: a forgotten `model:` section
    must not fall back on the schema's default, a 30B model the user never chose."""
    model = data.get("model")
    if isinstance(model, dict) and model.get("id"):
        return True
    return any(o.partition("=")[0].strip() in ("model.id", "model") for o in overrides)


RUN_MARKS = ("versions.json", "preflight.json", "adapter")  # what only a run dir holds


def is_run_config(path: Path) -> bool:
    """Whether `path` is the config.yaml a run saved in its dir (read back: rebased there)."""
    return path.name == "config.yaml" and any((path.parent / m).exists() for m in RUN_MARKS)


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML (written beside every run's outputs), secret lane.env
    values masked: they reach a pod through its environment, never through a file."""
    register_secrets(lane_secrets(cfg))  # a config built in code, not parsed, alike
    doc = cfg.model_dump(mode="json")
    doc["lane"]["env"] = public_env(doc["lane"]["env"], cfg.lane.public_env)
    return yaml.safe_dump(masked(doc), sort_keys=False)


def _nested_model(annotation: Any) -> tuple[type[BaseModel] | None, str]:
    """The section class a field holds (directly or as list items), and the path suffix."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    args = getattr(annotation, "__args__", ())
    if args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0], "[]"
    return None, ""


def _fields(cls: type[BaseModel], prefix: str) -> list[tuple[str, FieldInfo]]:
    rows = []
    for name, field in cls.model_fields.items():
        path = f"{prefix}{name}"
        nested, suffix = _nested_model(field.annotation)
        if nested is not None:  # a section (or list of them): document its fields instead
            rows.extend(_fields(nested, f"{path}{suffix}."))
            continue
        rows.append((path, field))
    return rows


def schema_fields() -> list[tuple[str, FieldInfo]]:
    """(field path, its pydantic field) for every field of run.yaml, in schema order; a list
    of sections (eval.rungs) is documented by its items' fields (`eval.rungs[].name`)."""
    return _fields(RunConfig, "")


def default_text(field: FieldInfo) -> str:
    """The field's default as Python writes it, or `(required)`."""
    if field.is_required():
        return "(required)"
    return repr(field.get_default(call_default_factory=True))


def schema_rows() -> list[tuple[str, str, str]]:
    """(field path, default, description) for every field: the documentation of run.yaml."""
    return [(p, default_text(f), f.description or "") for p, f in schema_fields()]
