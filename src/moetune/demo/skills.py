"""Synthetic skills for the demo base: a registry of `(prompt, answer)` generators.

A skill is a name plus `make(rng) -> (prompt, answer)`; prompts look like `copy:abc>` and
answers like `abc`. Base skills are what the shipped base is pretrained on; new skills
are fine-tune targets the base has never seen. Train and held-out eval items are split
by a hash of the prompt, so no eval prompt can appear in training data, whatever the
seed or the number of rows.
"""

from __future__ import annotations

import hashlib
import json
import random
import string
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from moetune.demo.tokenizer import EOS
from moetune.io import atomic_write_text

Split = Literal["train", "eval"]
LETTERS = string.ascii_lowercase
EVAL_BUCKETS = 8  # one prompt-hash bucket in eight is held out for evaluation


@dataclass(frozen=True)
class Item:
    """One example: the model sees `prompt` and must produce `answer`, then EOS."""

    skill: str
    prompt: str
    answer: str


@dataclass(frozen=True)
class Skill:
    name: str
    make: Callable[[random.Random], tuple[str, str]]
    new: bool  # True: a fine-tune target the base is never trained on
    description: str


SKILLS: dict[str, Skill] = {}


def skill(
    name: str, answer: Callable[[str], str], *, new: bool = False
) -> Callable[[Callable[[random.Random], str]], Skill]:
    """Register a skill: the decorated `draw(rng)` makes the argument, `answer(arg)` solves it."""

    def wrap(draw: Callable[[random.Random], str]) -> Skill:
        def make(rng: random.Random) -> tuple[str, str]:
            arg = draw(rng)
            return f"{name}:{arg}>", answer(arg)

        entry = Skill(name, make, new, (draw.__doc__ or "").strip())
        SKILLS[name] = entry
        return entry

    return wrap


def _letters(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))


def _kv_answer(arg: str) -> str:
    pairs, key = arg.split("?")
    return dict(zip(pairs[::2], pairs[1::2], strict=True))[key]


@skill("copy", lambda s: s)
def _copy(rng: random.Random) -> str:
    """copy:abc>abc – repeat 2–8 letters."""
    return _letters(rng, 2, 8)


@skill("rev", lambda s: s[::-1])
def _rev(rng: random.Random) -> str:
    """rev:abc>cba – reverse 2–8 letters."""
    return _letters(rng, 2, 8)


@skill("first", lambda s: s[0])
def _first(rng: random.Random) -> str:
    """first:abc>a – the first of 1–8 letters."""
    return _letters(rng, 1, 8)


@skill("sum", lambda s: str(sum(int(c) for c in s)))
def _sum(rng: random.Random) -> str:
    """sum:123>6 – the sum of 1–4 digits."""
    return "".join(rng.choice(string.digits) for _ in range(rng.randint(1, 4)))


@skill("kv", _kv_answer)
def _kv(rng: random.Random) -> str:
    """kv:a1b2c3?b>2 – look up a key among 2–4 distinct letter->digit pairs."""
    keys = rng.sample(LETTERS, rng.randint(2, 4))
    pairs = "".join(k + rng.choice(string.digits) for k in keys)
    return f"{pairs}?{rng.choice(keys)}"


@skill("last", lambda s: s[-1], new=True)
def _last(rng: random.Random) -> str:
    """last:abc>c – the last of 2–8 letters (new)."""
    return _letters(rng, 2, 8)


@skill("dup", lambda s: "".join(c + c for c in s), new=True)
def _dup(rng: random.Random) -> str:
    """dup:abc>aabbcc – double each of 2–5 letters (new)."""
    return _letters(rng, 2, 5)


def base_skills() -> list[str]:
    return [s.name for s in SKILLS.values() if not s.new]


def new_skills() -> list[str]:
    return [s.name for s in SKILLS.values() if s.new]


def split_of(prompt: str) -> Split:
    """Which split a prompt belongs to; a pure function of the text, so splits never overlap."""
    bucket = hashlib.blake2b(prompt.encode(), digest_size=2).digest()[0] % EVAL_BUCKETS
    return "eval" if bucket == 0 else "train"


def _rng(seed: int, *parts: str) -> random.Random:
    # str seeds hash with sha512 in `random`, so streams are stable across runs and platforms
    return random.Random(f"{seed}/{'/'.join(parts)}")


def stream(names: Sequence[str], seed: int, split: Split = "train") -> Iterator[Item]:
    """An endless, seeded stream of items from `names` (uniform over skills) in one split."""
    rng = _rng(seed, "stream", split, *names)
    while True:
        name = rng.choice(names)
        prompt, answer = SKILLS[name].make(rng)
        if split_of(prompt) == split:
            yield Item(name, prompt, answer)


def make_items(names: Iterable[str], n: int, seed: int, split: Split = "eval") -> list[Item]:
    """`n` distinct items per skill, deterministic from `seed`; grouped by skill, in order."""
    out: list[Item] = []
    for name in names:
        rng, seen = _rng(seed, name, split), set[str]()
        for _ in range(n * 200):  # bounded: a tiny prompt space must not loop forever
            prompt, answer = SKILLS[name].make(rng)
            if split_of(prompt) == split and prompt not in seen:
                seen.add(prompt)
                out.append(Item(name, prompt, answer))
            if len(seen) == n:
                break
        else:
            raise ValueError(f"skill {name!r} has fewer than {n} distinct {split} prompts")
    return out


def to_prompt_completion(items: Iterable[Item], end: str = EOS) -> list[dict[str, str]]:
    """TRL prompt/completion rows; `end` (the EOS text) marks where the answer stops.

    TRL's SFTTrainer appends EOS only when the completion does not already end with it,
    so explicit markers are never doubled.
    """
    return [{"prompt": it.prompt, "completion": it.answer + end} for it in items]


def to_text(items: Iterable[Item], end: str = EOS) -> list[dict[str, str]]:
    """Plain language-modelling rows (`{"text": ...}`)."""
    return [{"text": it.prompt + it.answer + end} for it in items]


def write_jsonl(path: str | Path, rows: Iterable[dict[str, str]]) -> Path:
    """Write rows atomically (temp file + rename) so a crash never leaves half a file."""
    path = Path(path)
    atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in rows))
    return path
