"""The training mix: sources weighted and interleaved with the run's seed, and the eval rows
carved off by a hash of each row when no eval source is named.

Everything here is a pure function of the rows, the weights and the seed (string seeds hash
the same in every process), so a resumed run and every rank of a distributed one see the
same rows in the same order.

    weight 2     each row of the source twice per epoch
    weight 0.5   a seeded half of its rows
    streaming    each next row drawn from a source with probability ∝ its weight, until
                 every source is spent
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
_SCALE = float(1 << 64)


def row_key(row: Any) -> str:
    """A row's content hash (key order does not matter): duplicates share it."""
    blob = json.dumps(row, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def held_out(row: Any, fraction: float) -> bool:
    """Whether a row falls in the eval share: its hash, not its position, decides."""
    return int(row_key(row)[:16], 16) / _SCALE < fraction


def weighted_count(rows: int, weight: float) -> int:
    """How many rows `weighted` gives for a source of `rows` rows."""
    whole, part = divmod(weight, 1.0)
    return rows * int(whole) + round(part * rows)


def weighted(rows: Sequence[T], weight: float, seed: str) -> list[T]:
    """The rows `weight` times: whole repeats, then a seeded sample for the fraction."""
    whole, part = divmod(weight, 1.0)
    extra = random.Random(seed).sample(list(rows), round(part * len(rows)))
    return list(rows) * int(whole) + extra


def mix(parts: Sequence[tuple[Sequence[T], float]], seed: int) -> list[T]:
    """Weighted rows of every source, shuffled together with the seed (one source at weight 1
    is kept in its own order)."""
    if len(parts) == 1 and parts[0][1] == 1.0:
        return list(parts[0][0])
    out = [r for n, (rows, w) in enumerate(parts) for r in weighted(rows, w, f"{seed}:{n}")]
    random.Random(f"mix:{seed}").shuffle(out)
    return out


def interleave(streams: Sequence[Iterator[T]], weights: Sequence[float], seed: int) -> Iterator[T]:
    """Rows drawn from the streams with probability ∝ weight until all are spent."""
    rng = random.Random(f"stream:{seed}")
    live = list(range(len(streams)))
    while live:
        n = rng.choices(live, [weights[i] for i in live])[0]
        try:
            yield next(streams[n])
        except StopIteration:
            live.remove(n)
