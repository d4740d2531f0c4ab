"""Trap rules: each known way an MoE fine-tune fails silently or late, as executable knowledge.

A rule has an id, a severity, a `check` that reads a run config (plus what the planner
knows) and returns a Finding saying what will happen and how to fix it, and a `probe`
that demonstrates the trap on the installed library versions (tests/test_probes.py fails
when a trap stops reproducing, so a fixed library prompts a review instead of a stale rule).

    findings = lint(LintContext(config=cfg, spec=spec, family=None))

Rules live in `rules_peft.py`, `rules_mlx.py`, `rules_infra.py`, `rules_dist.py` and
`rules_serve.py`; add one by decorating its check with `@register_rule(...)` and importing
its module in `moetune/lint/__init__.py` – this registry imports none of them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any, Literal

from moetune.config import RunConfig
from moetune.model import OVERRIDES, get_family
from moetune.model.families.registry import Family, ModulePaths
from moetune.model.spec import ModelSpec
from moetune.plan.cost.walls import Site
from moetune.registry import Registry

Severity = Literal["error", "warn", "info"]
SEVERITY_ORDER: dict[str, int] = {"error": 0, "warn": 1, "info": 2}
# Libraries whose versions decide which traps exist; absent ones are left out of `versions`.
TRACKED_LIBRARIES = (
    "torch",
    "transformers",
    "peft",
    "trl",
    "mlx-lm",
    "bitsandbytes",
    "huggingface_hub",
    "hf-xet",
)


@dataclass(frozen=True)
class Finding:
    """One trap found in a run: what will happen (one line), the fix, and the config field."""

    rule_id: str
    severity: Severity
    message: str
    fix: str
    field: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Hit:
    """What a rule's check returns; the engine adds the rule id (and default severity)."""

    message: str
    fix: str
    field: str | None = None
    severity: Severity | None = None  # overrides the rule's default when a case is milder/worse


@dataclass(frozen=True)
class ProbeOutcome:
    """Whether the trap still reproduces on the installed libraries, and what showed it."""

    trap_present: bool
    evidence: str


class ProbeUnavailable(Exception):
    """A probe cannot run here (library absent, needs a GPU); the message says why."""


def installed_versions() -> dict[str, str]:
    """Versions of TRACKED_LIBRARIES that are installed."""
    found: dict[str, str] = {}
    for name in TRACKED_LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def _family_of(spec: ModelSpec | None) -> Family | None:
    """The family of `spec` where an override says what its mlx-lm modules are called
    (importing moetune.model registers them all); None leaves the path rules silent."""
    return get_family(spec.model_type) if spec and spec.model_type in OVERRIDES else None


@dataclass
class LintContext:
    """Everything the rules may read. Only `config` is required; a rule whose inputs are
    missing (no spec, no plan, no estimate) stays silent rather than guessing."""

    config: RunConfig
    spec: ModelSpec | None = None
    family: Family | None = None
    peak_bytes: int | None = None  # planned peak including allocator/context overhead
    card_id: str | None = None
    card_usable_bytes: int | None = None
    estimated_train_s: float | None = None
    trainable_params: int | None = None  # from the recipe, when counted
    site: Site = field(default_factory=Site)  # where it runs: the lane fills it from a provider
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    versions: Mapping[str, str] = field(default_factory=installed_versions)

    def __post_init__(self) -> None:
        if self.family is None:
            self.family = _family_of(self.spec)

    @property
    def paths(self) -> ModulePaths | None:
        """The family's module paths for this very model (some depend on the config)."""
        if self.family is None:
            return None
        return self.family.paths_of(self.spec) if self.spec is not None else self.family.paths

    @property
    def is_moe(self) -> bool:
        """True when the spec says MoE; unknown (no spec) counts as MoE – moetune's case."""
        return self.spec is None or self.spec.is_moe


CheckFn = Callable[[LintContext], Hit | None]
ProbeFn = Callable[[], ProbeOutcome]


@dataclass(frozen=True)
class Rule:
    """A registered trap: `check` a run, `probe` the installed libraries."""

    id: str
    severity: Severity
    title: str
    libraries: tuple[str, ...]  # where the trap lives; named when the probe stops reproducing
    check_fn: CheckFn
    probe_fn: ProbeFn
    # the stage that uses the thing refuses it itself, in this very line, --allow-errors or
    # not: train's preflight leaves it to that stage (TOKENIZER: data/tokenizer.py)
    enforced: bool = False

    def check(self, ctx: LintContext) -> Finding | None:
        hit = self.check_fn(ctx)
        if hit is None:
            return None
        severity = hit.severity or self.severity
        return Finding(self.id, severity, hit.message, hit.fix, hit.field)

    def probe(self) -> ProbeOutcome:
        return self.probe_fn()


RULES: Registry[Rule] = Registry("lint rule")


def register_rule(
    rule_id: str,
    severity: Severity,
    title: str,
    *,
    probe: ProbeFn,
    libraries: tuple[str, ...] = (),
    enforced: bool = False,
) -> Callable[[CheckFn], CheckFn]:
    """Register the decorated check as rule `rule_id`; ids are unique."""

    def decorate(check: CheckFn) -> CheckFn:
        RULES.add(rule_id, Rule(rule_id, severity, title, libraries, check, probe, enforced))
        return check

    return decorate


def lint(ctx: LintContext) -> list[Finding]:
    """Every rule's finding for `ctx`, errors first, then by rule id."""
    findings = [f for _, rule in RULES.items() if (f := rule.check(ctx)) is not None]
    return sorted(findings, key=lambda f: (SEVERITY_ORDER[f.severity], f.rule_id))


def rule_table() -> list[dict[str, str]]:
    """One row per rule (id, severity, title, libraries) for docs and the CLI."""
    return [
        {
            "id": r.id,
            "severity": r.severity,
            "title": r.title,
            "libraries": ", ".join(r.libraries) or "-",
        }
        for _, r in RULES.items()
    ]


def versions_of(libraries: tuple[str, ...], versions: Mapping[str, str] | None = None) -> str:
    """'peft 0.21.2, transformers 5.24.0' for messages; absent libraries say so."""
    found = installed_versions() if versions is None else versions
    return ", ".join(f"{lib} {found.get(lib, '(absent)')}" for lib in libraries) or "-"
