"""GRPO reward functions: a registry of named builders, or a user's `module:function`.

Each reward is built from its `RewardArgs` into a callable with TRL's reward signature,
`f(prompts, completions, **columns) -> list[float]`, where `columns` are the prompt rows'
other data columns, one value per completion. A completion is a string (plain prompts)
or a list of messages (conversational ones); rewards score its text.

    exact_match   1.0 when the completion, stripped, equals the row's `column` column
    edit_similarity  1 - Levenshtein distance / the longer length, against that column:
                  1.0 exactly when exact_match is; partial credit for a near miss (the
                  right answer and no stop yet), which exact match scores like nonsense
    regex         1.0 when the completion matches `pattern` (re.fullmatch, DOTALL)
    length        1 - |chars - target_chars| / target_chars, at least 0

Every reward is guarded (`GuardedReward`): a value that is not a finite number (NaN, Inf,
not a number at all) is a failed reward – given to TRL as None ("no reward", which its
nansum leaves out), counted, and reported in the run's warnings; a call whose every value
failed stops the run naming the reward, since a step with no reward learns nothing.
"""

from __future__ import annotations

import functools
import importlib
import math
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from moetune.errors import clip
from moetune.registry import Registry
from moetune.train.errors import TrainError

if TYPE_CHECKING:
    from moetune.config import GrpoArgs, RewardArgs

RewardFunc = Callable[..., list[float]]


class RewardError(TrainError):
    """A GRPO reward that cannot be built: unknown name, bad import, missing setting."""


def completion_text(completion: Any) -> str:
    """The text of one completion: a string, or the content of its last message."""
    if isinstance(completion, str):
        return completion
    return str(completion[-1]["content"]) if completion else ""


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions), one row at a time."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def similarity(text: str, answer: str) -> float:
    """1 - edit distance / the longer length: 1.0 only for the answer itself, 0.0 for
    nothing in common (and for an empty completion)."""
    longest = max(len(text), len(answer))
    return 1.0 - edit_distance(text, answer) / longest if longest else 1.0


Score = Callable[[str, str], float]  # (completion text, answer) -> reward


def _against_answer(name: str, score: Score) -> Callable[[RewardArgs], RewardFunc]:
    """A reward scoring each completion's text against the row's `column` (both stripped);
    `name` is what TRL logs it under."""

    def build(args: RewardArgs) -> RewardFunc:
        column = args.column

        def reward(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
            return [
                score(completion_text(c).strip(), str(a).strip())
                for c, a in zip(completions, columns[column], strict=True)
            ]

        reward.__name__ = reward.__qualname__ = name
        return reward

    return build


# the registered rewards that read the row's answer column
ANSWER_SCORES: dict[str, Score] = {
    "exact_match": lambda text, answer: float(text == answer),  # 1.0 or 0.0
    "edit_similarity": similarity,
}


def _regex(args: RewardArgs) -> RewardFunc:
    if not args.pattern:
        raise RewardError(
            "reward regex needs a pattern", "set pattern: in that train.grpo.rewards entry"
        )
    try:
        compiled = re.compile(args.pattern, re.DOTALL)
    except re.error as exc:
        raise RewardError(
            f"reward regex: {args.pattern!r} is not a valid pattern ({exc})", "fix the pattern"
        ) from None

    def regex(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        return [float(compiled.fullmatch(completion_text(c)) is not None) for c in completions]

    return regex


def _length(args: RewardArgs) -> RewardFunc:
    target = args.target_chars
    if target is None:
        raise RewardError(
            "reward length needs target_chars", "set target_chars: in that rewards entry"
        )

    def length(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        return [max(0.0, 1 - abs(len(completion_text(c)) - target) / target) for c in completions]

    return length


REWARDS: Registry[Callable[[RewardArgs], RewardFunc]] = Registry("reward", RewardError)
for _name, _score in ANSWER_SCORES.items():
    REWARDS.add(_name, _against_answer(_name, _score))
REWARDS.add("regex", _regex)
REWARDS.add("length", _length)


def _imported(spec: str) -> RewardFunc:
    """`package.module:function`, imported; RewardError naming what is missing."""
    module_name, _, attr = spec.partition(":")
    fix = "write module:function with the module importable (on PYTHONPATH)"
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardError(f"reward {spec}: cannot import {module_name} ({exc})", fix) from None
    func = getattr(module, attr, None)
    if func is None:
        raise RewardError(f"reward {spec}: {module_name} has no {attr!r}", fix)
    if not callable(func):
        raise RewardError(f"reward {spec}: {attr} is a {type(func).__name__}, not a function", fix)
    return _naming(spec, func)


def _naming(spec: str, func: RewardFunc) -> RewardFunc:
    """`func`, with any exception it raises turned into one line naming the reward (a
    user's bug is exit 2 with its cause, not an unexpected error deep in TRL)."""

    @functools.wraps(func)  # TRL logs each reward under its __name__
    def reward(*args: Any, **kwargs: Any) -> list[float]:
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            raise RewardError(
                f"reward {spec} raised {type(exc).__name__}: {clip(exc, 120)}",
                "fix the function: it gets prompts, completions and the rows' other columns "
                "and returns one float per completion",
            ) from exc

    return reward


def build_reward(args: RewardArgs) -> RewardFunc:
    """One reward function, from the registry or imported."""
    if ":" in args.name:
        return _imported(args.name)
    if args.name not in REWARDS:
        raise RewardError(
            f"unknown reward {args.name!r}",
            f"use one of {', '.join(REWARDS.names())} or module:function",
        )
    return REWARDS.get(args.name)(args)


class GuardedReward:
    """A reward function whose non-finite values are failed rewards (counted, None to TRL);
    a call with no finite value at all is a RewardError naming the reward."""

    def __init__(self, name: str, func: RewardFunc) -> None:
        self.name, self.func = name, func
        self.__name__ = getattr(func, "__name__", name)  # TRL's metric key: rewards/<name>
        self.failed = self.scored = 0

    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[Any]:
        got = self._checked(self.func(prompts, completions, **columns), len(completions))
        values = [_finite_or_none(v) for v in got]
        failed = sum(v is _FAILED for v in values)
        self.failed, self.scored = self.failed + failed, self.scored + len(values)
        if values and failed == len(values):
            raise RewardError(
                f"reward {self.name} returned no finite value for any of the {len(values)} "
                "completions of a step (NaN, Inf or not a number): the step cannot learn",
                "make the reward return a finite number (or None: no reward) per completion",
            )
        return [None if v is _FAILED else v for v in values]

    def _checked(self, got: Any, wanted: int) -> Any:
        """`got` when it is one value per completion; a RewardError naming the reward and
        what it returned otherwise (a dict, None or a short list reached TRL as a bare
        TypeError or ValueError, or as "no finite value")."""
        fix = "return a list with one float (or None: no reward) per completion, in order"
        if isinstance(got, str | bytes | Mapping) or not hasattr(got, "__len__"):
            what = "None" if got is None else f"a {type(got).__name__}"
            raise RewardError(f"reward {self.name} returned {what}, not a list of values", fix)
        if len(got) != wanted:
            raise RewardError(
                f"reward {self.name} returned {len(got)} values for {wanted} completions", fix
            )
        return got

    def warning(self) -> str | None:
        """The run's warning when some of this reward's values failed."""
        if not self.failed:
            return None
        return (
            f"reward {self.name}: {self.failed} of {self.scored} values were not finite "
            "numbers; each counted as a failed reward (no reward for that completion)"
        )


_FAILED = object()  # a value that was not a finite number


def _finite_or_none(value: Any) -> Any:
    """`value` as a float, None kept (TRL's "no reward"), anything else _FAILED."""
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return _FAILED
    return number if math.isfinite(number) else _FAILED


def build_rewards(grpo: GrpoArgs) -> tuple[list[RewardFunc], list[float]]:
    """Every configured reward (guarded) and its weight, in order."""
    if not grpo.rewards:
        raise RewardError("train.grpo.rewards is empty", "add a reward, e.g. name: exact_match")
    funcs: list[RewardFunc] = [GuardedReward(r.name, build_reward(r)) for r in grpo.rewards]
    return funcs, [r.weight for r in grpo.rewards]


def dry_call(funcs: list[RewardFunc], row: dict[str, Any], group: int) -> None:
    """Each guarded reward called once, before any weight loads, as TRL calls it: `row`'s
    prompt `group` times with a stand-in (empty) completion and its other columns. A dict,
    None or a wrong count is refused now, not after the model is built and a rollout ran;
    a reward that raises on the stand-in is left to its first real call (an empty
    completion may be what it cannot score), so only the shape is judged here."""
    prompt = row.get("prompt")
    stand_in: Any = [{"role": "assistant", "content": ""}] if isinstance(prompt, list) else ""
    columns = {k: [v] * group for k, v in row.items() if k not in ("prompt", "completion")}
    kwargs: dict[str, Any] = {
        **columns, "completion_ids": [[] for _ in range(group)], "trainer_state": None,
        "log_extra": lambda *_, **__: None, "log_metric": lambda *_, **__: None,
    }  # fmt: skip
    for func in funcs:
        if not isinstance(func, GuardedReward):
            continue
        try:
            got = func.func(prompts=[prompt] * group, completions=[stand_in] * group, **kwargs)
        except RewardError as exc:
            if exc.__cause__ is None:  # moetune's own refusal (a missing column …)
                raise
            continue
        except Exception:
            continue
        func._checked(got, group)


def reward_warnings(trainer: Any) -> list[str]:
    """One warning per guarded reward of `trainer` (a GRPO trainer) whose values failed."""
    guarded = [f for f in getattr(trainer, "reward_funcs", []) if isinstance(f, GuardedReward)]
    return [w for f in guarded if (w := f.warning()) is not None]


def reward_columns(grpo: GrpoArgs) -> list[str]:
    """The data columns the registered rewards read (their answer field)."""
    return sorted({r.column for r in grpo.rewards if r.name in ANSWER_SCORES})
