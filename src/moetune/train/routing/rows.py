"""Which training rows the base's routing (and the expert selection) is measured on, and
how they are collated: a few hundred rows spread over the set, or a stream's first ones."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch

BASE_ROWS = 256  # training rows the base's routing is measured on
# offloaded experts: every forward streams the whole base, so the base's routing is measured
# in one forward of at most this many tokens (at least one batch) instead of BASE_ROWS / batch
OFFLOAD_BASE_TOKENS = 8192


def base_sample(batch: int, seq_len: int, offloaded: bool) -> tuple[int, int]:
    """(batch, rows) the base's routing is measured in: the trainer's batches over BASE_ROWS
    rows; offloaded, one forward (each reads every layer's experts from host RAM or disk)."""
    if not offloaded:
        return batch, BASE_ROWS
    rows = min(BASE_ROWS, max(batch, OFFLOAD_BASE_TOKENS // max(seq_len, 1)))
    return rows, rows


def sampled(dataset: Any, limit: int) -> tuple[Any, list[int]]:
    """(rows, the indices to read): up to `limit` rows spread evenly over the dataset; a
    streamed one (data.streaming) has no length, so its first `limit` rows."""
    if hasattr(dataset, "__len__"):
        return dataset, sample_rows(len(dataset), limit)
    head = list(itertools.islice(dataset, limit))
    return head, list(range(len(head)))


def sample_rows(total: int, rows: int) -> list[int]:
    """Up to `rows` row indices spread evenly over a dataset of `total` rows."""
    n = min(total, rows)
    return [i * total // n for i in range(n)]


def batches(
    dataset: Any, collate: Callable[[list[Any]], dict[str, Any]], rows: list[int],
    batch_size: int, device: torch.device,
) -> Iterator[dict[str, Any]]:  # fmt: skip
    """The rows as the trainer collates them, model inputs only (no labels: no loss)."""
    for start in range(0, len(rows), batch_size):
        batch = collate([dataset[i] for i in rows[start : start + batch_size]])
        batch.pop("labels", None)
        yield {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
