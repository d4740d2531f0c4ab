"""Token-level scoring shared by the rungs: greedy generation and continuation log-likelihood.

Sequences are batched by token length, so no padding is needed: a model sees exactly the
sequence it would see alone, and an item's score never depends on its batch mates – the
property that makes base-vs-candidate differences truly paired.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

Advance = Callable[[int], None]


def by_length(seqs: Sequence[Sequence[int]], batch_size: int) -> Iterable[list[int]]:
    """Index batches whose sequences all share one token length."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(seqs):
        groups[len(ids)].append(i)
    for idx in groups.values():
        for start in range(0, len(idx), batch_size):
            yield idx[start : start + batch_size]


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


def greedy(model: Any, ids: torch.Tensor, limits: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Append argmax tokens until each row has emitted EOS or reached its own limit."""
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    out = ids
    for step in range(int(limits.max())):
        nxt = model(input_ids=out).logits[:, -1, :].argmax(dim=-1)
        out = torch.cat([out, nxt[:, None]], dim=1)
        done |= (nxt == eos_id) | (step + 1 >= limits)
        if bool(done.all()):
            break
    return out[:, ids.shape[1] :]


@torch.no_grad()
def generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    limits: Sequence[int],
    eos_id: int,
    batch_size: int,
    advance: Advance = lambda n: None,
) -> list[list[int]]:
    """Greedy continuations (new token ids, EOS included when emitted) for every prompt."""
    out: list[list[int]] = [[] for _ in prompts]
    device = _device(model)
    for idx in by_length(prompts, batch_size):
        ids = torch.tensor([list(prompts[i]) for i in idx], device=device)
        lim = torch.tensor([limits[i] for i in idx], device=device)
        for i, row in zip(idx, greedy(model, ids, lim, eos_id).cpu().tolist(), strict=True):
            out[i] = row
        advance(len(idx))
    return out


def until_eos(new_ids: list[int], eos_id: int) -> tuple[list[int], bool]:
    """The ids before the first EOS, and whether EOS was emitted at all."""
    if eos_id in new_ids:
        return new_ids[: new_ids.index(eos_id)], True
    return new_ids, False


@torch.no_grad()
def continuation_logprobs(
    model: Any,
    contexts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    batch_size: int,
    advance: Advance = lambda n: None,
) -> list[tuple[float, int]]:
    """(sum of log p(token), token count) of each continuation given its context."""
    seqs = [[*c, *t] for c, t in zip(contexts, continuations, strict=True)]
    out: list[tuple[float, int]] = [(0.0, 0)] * len(seqs)
    device = _device(model)
    for idx in by_length(seqs, batch_size):
        ids = torch.tensor([seqs[i] for i in idx], device=device)
        logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), dim=-1)
        token_logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        for row, i in enumerate(idx):
            start = len(contexts[i]) - 1  # logits at position p predict token p + 1
            out[i] = (float(token_logp[row, start:].sum()), len(continuations[i]))
        advance(len(idx))
    return out
