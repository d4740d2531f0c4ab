"""GM-1's generated corpus: a small grammar, arithmetic facts and the demo's skills.

Documents come from a few "domains" with real structure – subject-verb agreement across
a relative clause (`the cat that the dogs chase sees a bird`), digit arithmetic
(`3 plus 4 is 7`), counting runs and the demo's synthetic skills (`rev:abc>cba`) – so a
router has something to specialise on and a model something to learn beyond unigrams.
Each document is assigned to train or held-out by a hash of its text (the demo's
`split_of`), so no held-out document ever appears in training, whatever the seed. Documents
end with EOS and are packed back to back into rows of `seq` tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import torch

from moetune.demo.skills import SKILLS, Split, base_skills, split_of
from moetune.demo.tokenizer import EOS, vocabulary

# (singular, plural) pairs: the verb of a clause must agree with its subject's number
NOUNS = (("cat", "cats"), ("dog", "dogs"), ("bird", "birds"), ("fox", "foxes"),
         ("child", "children"), ("mouse", "mice"), ("horse", "horses"))  # fmt: skip
VERBS = (("sees", "see"), ("likes", "like"), ("chases", "chase"), ("finds", "find"),
         ("hears", "hear"), ("follows", "follow"))  # fmt: skip
ADJECTIVES = ("big", "small", "red", "old", "quick", "lazy", "brown")
PLURAL_DETS = ("the", "two", "three", "some", "many")
HELDOUT_SEED = 1_000_003  # one held-out set for every seed and arm


def _noun_phrase(rng: random.Random, depth: int = 0) -> tuple[str, bool]:
    """(text, plural): `det [adj] noun [that NP verb]` – the clause's verb agrees with its
    own subject, the head noun's number is what the main verb must agree with."""
    plural = rng.random() < 0.5
    noun = rng.choice(NOUNS)[plural]
    det = rng.choice(PLURAL_DETS) if plural else rng.choice(("the", "a", "one"))
    words = [det, *([rng.choice(ADJECTIVES)] if rng.random() < 0.4 else []), noun]
    if depth == 0 and rng.random() < 0.3:
        inner, inner_plural = _noun_phrase(rng, depth + 1)
        words += ["that", inner, rng.choice(VERBS)[inner_plural]]
    return " ".join(words), plural


def sentence(rng: random.Random) -> str:
    subject, plural = _noun_phrase(rng)
    obj, _ = _noun_phrase(rng, depth=1)
    return f"{subject} {rng.choice(VERBS)[plural]} {obj}"


def _grammar(rng: random.Random) -> str:
    return ", ".join(sentence(rng) for _ in range(rng.randint(1, 3)))


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    if rng.random() < 0.5:
        return f"{a} plus {b} is {a + b}"
    hi, lo = max(a, b), min(a, b)
    return f"{hi} minus {lo} is {hi - lo}"


def _counting(rng: random.Random) -> str:
    start, step = rng.randint(0, 20), rng.randint(1, 3)
    return "count " + " ".join(str(start + i * step) for i in range(rng.randint(3, 7)))


def _skill(rng: random.Random) -> str:
    prompt, answer = SKILLS[rng.choice(base_skills())].make(rng)
    return prompt + answer


# domain -> (weight, generator); registered, so a new domain is one line
DOMAINS: dict[str, tuple[float, Callable[[random.Random], str]]] = {
    "grammar": (0.45, _grammar),
    "arithmetic": (0.2, _arithmetic),
    "counting": (0.1, _counting),
    "skills": (0.25, _skill),
}


def documents(seed: int, split: Split) -> Iterator[str]:
    """An endless, deterministic stream of documents of one split."""
    rng = random.Random(f"gm1/{seed}/{split}")  # str seeds hash stably (sha512)
    names = list(DOMAINS)
    weights = [DOMAINS[n][0] for n in names]
    while True:
        doc = DOMAINS[rng.choices(names, weights)[0]][1](rng)
        if split_of(doc) == split:
            yield doc


def encode(text: str) -> list[int]:
    vocab = vocabulary()
    return [vocab[c] for c in text]


def vocab_size() -> int:
    return len(vocabulary())


def token_rows(seed: int, split: Split, rows: int, seq: int) -> torch.Tensor:
    """`rows` packed rows of `seq` token ids [rows, seq] from the documents of a split."""
    vocab, need, ids = vocabulary(), rows * seq, list[int]()
    for doc in documents(seed, split):
        ids += [vocab[c] for c in doc]
        ids.append(vocab[EOS])
        if len(ids) >= need:
            break
    return torch.tensor(ids[:need], dtype=torch.long).reshape(rows, seq)


def heldout_rows(rows: int, seq: int) -> torch.Tensor:
    """The held-out set: the same rows for every seed and arm."""
    return token_rows(HELDOUT_SEED, "eval", rows, seq)
