"""The shortcut options: each one is a run config field under a short flag (`--rank` is
lora.rank), so a flag and its field cannot drift. Its help is made from the field – what it
means and what it accepts (Literal choices, the number rule) – and a value is checked
against the field's own type before it becomes a `--set` assignment, so a flag accepts
exactly what the field accepts. None means "not given": YAML and defaults win.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args, get_origin

import typer
from pydantic import TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from moetune.config.fields import bare as _base
from moetune.config.fields import comma_list, field_at, field_rule
from moetune.errors import ConfigError


@dataclass(frozen=True)
class Shortcut:
    """A flag for a config field; `comma` flags take a comma list for a list field, a
    `negate` flag (a bool switch) sets its bool field to false, a `switch` flag to true."""

    flag: str
    field: str
    what: str  # a short help phrase (the field's description is the long one)
    comma: bool = False
    negate: bool = False
    switch: bool = False  # a bool switch that sets its bool field to true


# Parameter name → its flag and field. Flags a command reads without setting the field
# (plan's --gpus and --strategy size the per-device report) still take the field's values.
SHORTCUTS: dict[str, Shortcut] = {
    s.flag.removeprefix("--").replace("-", "_"): s
    for s in (
        Shortcut("--tuning", "train.tuning", "Fine-tuning kind (qlora: analytic)."),
        Shortcut("--method", "train.method", "Objective."),
        Shortcut("--rank", "lora.rank", "LoRA rank."),
        Shortcut("--seed", "train.seed", "Seed (the demo's rows and eval items too)."),
        Shortcut("--seq", "train.seq_len", "Sequence length in tokens."),
        Shortcut("--batch", "train.batch_size", "Micro-batch size."),
        Shortcut(
            "--no-gc", "train.gradient_checkpointing", "Gradient checkpointing off.", negate=True
        ),
        Shortcut("--targets", "lora.targets", "Parts that get LoRA.", comma=True),
        Shortcut(
            "--mapping",
            "lora.expert_mapping",
            "explicit (moetune) or automap (vanilla peft names).",
        ),
        Shortcut("--stack", "lora.stack", "Training stack: peft (TRL) or mlx (mlx-lm)."),
        Shortcut("--engine", "lora.engine", "Expert LoRA engine (moetune: split LoRA)."),
        Shortcut("--experts-dtype", "model.experts_dtype", "Frozen experts (moetune engine)."),
        Shortcut(
            "--trust-remote-code",
            "model.trust_remote_code",
            "Run the checkpoint's own modeling code (read it first).",
            switch=True,
        ),
        Shortcut("--nproc", "train.nproc", "Processes (one per GPU), through accelerate."),
        Shortcut("--gpus", "train.nproc", "Plan each of N data-parallel GPUs."),
        Shortcut(
            "--strategy",
            "train.strategy",
            "How the processes split the work (FSDP2, DeepSpeed ZeRO-3).",
        ),
        Shortcut("--provider", "lane.provider", "Where to run."),
        Shortcut("--offload", "train.offload", "Where frozen experts wait between uses."),
        Shortcut("--report-to", "output.report_to", "Trackers to log to.", comma=True),
        Shortcut("--host-ram", "hardware.host_ram_gb", "Host RAM per node in GB."),
        Shortcut("--nodes", "train.nnodes", "Nodes of --gpus GPUs each."),
        Shortcut("--nnodes", "train.nnodes", "Nodes of a multi-node run (--nproc ranks on each)."),
        Shortcut("--node-rank", "train.node_rank", "This node's rank (0 writes the run)."),
        Shortcut("--master-addr", "train.master_addr", "Node 0's address, the same on every node."),
        Shortcut("--master-port", "train.master_port", "The port node 0 listens on."),
        Shortcut(
            "--rdzv-timeout", "train.rdzv_timeout_s", "Seconds the nodes wait for each other."
        ),
        Shortcut("--hosts", "lane.ssh.hosts", "SSH hosts of the nodes, node 0 first.", comma=True),
    )
}


def field_info(path: str) -> FieldInfo:
    """The RunConfig field at `section.field` (a shortcut always names one)."""
    info = field_at(path)
    if info is None:
        raise KeyError(f"no run config field {path}")  # a shortcut's own typo: a bug here
    return info


def _is_list(path: str) -> bool:
    return get_origin(_base(field_info(path).annotation)) is list


def choices(path: str) -> list[str] | None:
    """A Literal field's values (a list field's item values), else None."""
    annotation = _base(field_info(path).annotation)
    if get_origin(annotation) is list:
        annotation = get_args(annotation)[0]
    return [str(v) for v in get_args(annotation)] if get_origin(annotation) is Literal else None


def accepts(path: str) -> str:
    """What the field accepts, in words: `a | b | c`, a number rule, or its type."""
    info = field_info(path)
    values = choices(path)
    if values is not None:
        joined = " | ".join(values)
        return f"a comma list of {joined}" if _is_list(path) else joined
    rule = field_rule(info)  # config.base's one-line rule of a constrained number
    if rule:
        return rule
    return str(getattr(_base(info.annotation), "__name__", ""))


def option_help(name: str, what: str = "", like: bool = False) -> str:
    """The flag's help: what it does, its field (`like` it, when the flag does not set
    it), and what that field accepts."""
    cut = SHORTCUTS[name]
    said = "false" if cut.negate else "true" if cut.switch else accepts(cut.field)
    # parentheses, not brackets: typer's help is rich markup, where [...] is a style tag
    return f"{what or cut.what} ({'like ' if like else ''}{cut.field}: {said})"


def opt(name: str, what: str = "", like: bool = False) -> Any:
    """The typer option for shortcut `name` (`what` replaces its help phrase)."""
    return typer.Option(SHORTCUTS[name].flag, help=option_help(name, what, like))


def checked(name: str, value: Any) -> Any:
    """`value` as the field's type, or a ConfigError naming the flag and what it accepts
    (None: not given)."""
    cut = SHORTCUTS[name]
    if value is None:
        return None
    if cut.comma and isinstance(value, str):
        value = comma_list(value)
    info = field_info(cut.field)
    try:
        meta = info.metadata
        typed: Any = Annotated[(info.annotation, *meta)] if meta else info.annotation
        adapter: TypeAdapter[Any] = TypeAdapter(typed)
        return adapter.validate_python(value)
    except ValidationError as err:
        shown = ",".join(value) if cut.comma else value
        raise ConfigError(
            f"{cut.flag} {shown}: {cut.field} {_problem(cut.field, err)}",
            f"pass {cut.flag} {accepts(cut.field)}",
        ) from None


def _problem(path: str, err: ValidationError) -> str:
    """What is wrong, as the field says it (a Literal field: the values it takes)."""
    msg = str(err.errors()[0]["msg"]).removeprefix("Value error, ")
    if msg.startswith("must be"):
        return msg
    one_of = choices(path) and not _is_list(path)
    return f"must be {'one of ' if one_of else ''}{accepts(path)}"


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):  # strings JSON-quoted (valid YAML): "[::1]:22" stays one item
        return "[" + ",".join(json.dumps(v) if isinstance(v, str) else str(v) for v in value) + "]"
    return str(value)


def option_overrides(**options: Any) -> list[str]:
    """Shortcut options as `--set` assignments (each checked against its field); None
    means "not given", so YAML and defaults win."""
    out = []
    for name, value in options.items():
        if SHORTCUTS[name].negate:
            value = False if value else None  # the switch only ever turns its field off
        elif SHORTCUTS[name].switch:
            value = True if value else None  # and this one only ever turns it on
        if value is not None:
            out.append(f"{SHORTCUTS[name].field}={_yaml(checked(name, value))}")
    return out
