"""Rung kinds: how one rung of the ladder turns a model into a score per item.

A kind is a registered class. `load` reads and checks the rung's items once (before any
model is loaded, so bad data fails in seconds); `score` returns one `ItemScore` per item,
in item order, for whatever model it is given – the base and the candidate get exactly
the same items, which is what makes their differences paired. Every score is "higher is
better": accuracy in [0, 1], or minus the mean negative log-likelihood per token.

    loss             {"text": ...} or {"prompt": ..., "completion": ...}   -NLL per token
    exact_match      {"prompt": ..., "answer": ...}    greedy output == answer (then EOS)
    contains         {"prompt": ..., "answer": ...}    the answer appears in the greedy output
    multiple_choice  {"prompt": ..., "choices": [...], "answer": index or choice}
    lm_eval          a task of lm-evaluation-harness (optional extra; see lmeval.py)

Prompts are rendered as the run's rows were (`self.rendering`, from its data.json): through
the chat template that trained the adapter, or as written.

This module holds the registry and the four built-in kinds; it imports no other kind
module – importing moetune.evaluate registers lmeval's.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from moetune.config import RungArgs
from moetune.data.errors import DataError
from moetune.data.rendering import RAW
from moetune.data.rungs import (
    RUNG_ROWS,
    Problem,
    answer_index,
    data_field,
    kind_problem,
    rung_items,
)
from moetune.evaluate.errors import EvalError
from moetune.evaluate.scoring import Advance, continuation_logprobs, generate, until_eos
from moetune.registry import Registry

Item = dict[str, Any]


@dataclass(frozen=True)
class ItemScore:
    score: float  # higher is better, in the rung's unit
    output: Any = None  # what the model produced (answer text, chosen index, token count)


class Rung(ABC):
    """One rung kind. Subclasses set `kind` and `unit` and implement `score` (`load`: the
    checked rows of its file, unless the kind reads its data another way)."""

    kind: ClassVar[str]
    unit: ClassVar[str] = "accuracy"  # accuracy | neg_nll

    def __init__(self, args: RungArgs, field: str | None = None) -> None:
        self.args = args
        # how the run's rows became text: the eval renders its prompts the same way
        self.rendering = RAW
        # what the user set to give this rung its file: named in every error about it
        self.field = field or data_field(args)

    @abstractmethod
    def score(
        self, model: Any, tokenizer: Any, items: list[Item], batch_size: int, advance: Advance
    ) -> list[ItemScore]:
        """One score per item, in order."""

    def extra(self, scores: list[float]) -> dict[str, float]:
        """Figures beside the mean that a person reads (e.g. perplexity)."""
        return {}

    def shown(self, item: Item) -> dict[str, Any]:
        """What a person reads of an item beside the models' outputs: its prompt and the
        expected answer (the per-item file, the gate's and the report's examples)."""
        prompt = item.get("prompt", item.get("text"))
        return {"prompt": prompt, "expected": item.get("answer", item.get("completion"))}

    # ------------------------------------------------------------ shared item reading

    def read_items(self, limit: int | None) -> list[Item]:
        """Rows of the data file, checked as lint and the train preflight check them; the
        first bad one raises with its file and line."""
        try:
            return rung_items(self.args, limit, self.field)
        except DataError as err:
            raise EvalError(err.cause, err.fix) from None

    def load(self, limit: int | None) -> list[Item]:
        return self.read_items(limit)


RUNG_KINDS: Registry[type[Rung]] = Registry("rung kind", EvalError)


def register_rung(cls: type[Rung]) -> type[Rung]:
    """A rung kind's scorer; its rows are declared in data/rungs.py's RUNG_ROWS first (lint
    and the train preflight check them there, below this floor)."""
    if cls.kind not in RUNG_ROWS:
        raise TypeError(f"rung kind {cls.kind!r}: declare its rows in RUNG_ROWS first")
    return RUNG_KINDS.add(cls.kind, cls)


def make_rung(args: RungArgs, field: str | None = None) -> Rung:
    """The rung object for a config entry (`field`: the option that gave its file, for
    errors); an unknown kind names the known ones."""
    if args.kind not in RUNG_KINDS:
        problem = kind_problem(args) or Problem(
            f"rung {args.name!r}: kind {args.kind!r} declares its rows but has no scorer",
            f"use one of: {', '.join(RUNG_KINDS.names())}",
        )
        raise EvalError(problem.cause, problem.fix)
    cls = RUNG_KINDS.get(args.kind)
    return cls(args, field)


def _ids(tokenizer: Any, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


# ---------------------------------------------------------------- loss / perplexity


@register_rung
class LossRung(Rung):
    """Held-out loss: minus the mean NLL per scored token (completion only, when given)."""

    kind = "loss"
    unit = "neg_nll"

    def _split(self, tokenizer: Any, item: Item) -> tuple[list[int], list[int]]:
        if "text" in item:
            ids = _ids(tokenizer, item["text"], True)
            return ids[:1], ids[1:]  # every token but the first is predicted
        prompt = self.rendering.prompt_ids(tokenizer, item["prompt"])
        return prompt, _ids(tokenizer, item["completion"], False)

    def score(
        self, model: Any, tokenizer: Any, items: list[Item], batch_size: int, advance: Advance
    ) -> list[ItemScore]:
        pairs = [self._split(tokenizer, item) for item in items]
        empty = [i for i, (_, cont) in enumerate(pairs) if not cont]
        if empty:
            raise EvalError(
                f"rung {self.args.name!r}: item {empty[0]} has no token to score",
                "give loss rows at least two tokens of text (or a non-empty completion)",
            )
        sums = continuation_logprobs(
            model, [c for c, _ in pairs], [t for _, t in pairs], batch_size, advance
        )
        return [ItemScore(total / count, count) for total, count in sums]

    def extra(self, scores: list[float]) -> dict[str, float]:
        mean = sum(scores) / len(scores) if scores else 0.0
        return {"perplexity": math.exp(-mean)}


# ---------------------------------------------------------------- exact match


@register_rung
class ExactMatchRung(Rung):
    """Greedy generation; right when the text before EOS (or the chat turn's end) equals the
    answer (stripped)."""

    kind = "exact_match"

    def _limit(self, tokenizer: Any, item: Item, end: str) -> int:
        # room for the answer and its end (EOS, or the turn's end): a model that runs past
        # it is wrong whatever follows
        room = len(_ids(tokenizer, end, False)) if end else 1
        return self.args.max_new_tokens or len(_ids(tokenizer, item["answer"], False)) + room

    def right(self, text: str, answer: str) -> bool:
        return text.strip() == answer.strip()

    def score(
        self, model: Any, tokenizer: Any, items: list[Item], batch_size: int, advance: Advance
    ) -> list[ItemScore]:
        eos, end = int(tokenizer.eos_token_id), self.rendering.turn_end(tokenizer)
        prompts = [self.rendering.prompt_ids(tokenizer, item["prompt"]) for item in items]
        limits = [self._limit(tokenizer, item, end) for item in items]
        outputs = generate(model, prompts, limits, eos, batch_size, advance)
        scores = []
        for item, new in zip(items, outputs, strict=True):
            text = str(tokenizer.decode(until_eos(new, eos)[0]))
            text = text.split(end, 1)[0] if end else text  # the turn's end closes the answer
            scores.append(ItemScore(float(self.right(text, item["answer"])), text))
        return scores


@register_rung
class ContainsRung(ExactMatchRung):
    """Greedy generation of up to max_new_tokens (default 64); right when the answer appears
    in the text before EOS (or the chat turn's end) – for answers inside a sentence."""

    kind = "contains"

    def _limit(self, tokenizer: Any, item: Item, end: str) -> int:
        return self.args.max_new_tokens or CONTAINS_TOKENS

    def right(self, text: str, answer: str) -> bool:
        return answer.strip() in text


CONTAINS_TOKENS = 64


# ---------------------------------------------------------------- multiple choice


@register_rung
class MultipleChoiceRung(Rung):
    """The choice with the highest log-likelihood after the prompt; right when it is the answer.

    Choices are appended to the prompt as written: include a leading space where the
    tokenizer expects one (" Paris"), as lm-evaluation-harness does."""

    kind = "multiple_choice"

    def shown(self, item: Item) -> dict[str, Any]:
        index = answer_index(item)
        expected = item["choices"][index] if index is not None else None
        return {"prompt": item.get("prompt"), "expected": expected}

    def score(
        self, model: Any, tokenizer: Any, items: list[Item], batch_size: int, advance: Advance
    ) -> list[ItemScore]:
        contexts, conts, owner = [], [], []
        for i, item in enumerate(items):
            ctx = self.rendering.prompt_ids(tokenizer, item["prompt"])
            for choice in item["choices"]:
                contexts.append(ctx)
                conts.append(_ids(tokenizer, choice, False))
                owner.append(i)
        sums = continuation_logprobs(model, contexts, conts, batch_size, lambda n: None)
        per_item: list[list[float]] = [[] for _ in items]
        for i, (total, _) in zip(owner, sums, strict=True):
            per_item[i].append(total)
        advance(len(items))
        picks = [max(range(len(ll)), key=ll.__getitem__) for ll in per_item]
        return [
            ItemScore(float(pick == answer_index(item)), pick)
            for item, pick in zip(items, picks, strict=True)
        ]
