"""Greedy exact match on demo skills, per item (so paired base-vs-candidate tests work).

Prompts are batched by token length, so no padding is needed: the model sees exactly
the sequence it would see alone and the answer does not depend on the batch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from moetune.demo.skills import Item, make_items
from moetune.evaluate.scoring import by_length, greedy


def _answer_tokens(tokenizer: PreTrainedTokenizerBase, item: Item) -> int:
    return len(tokenizer(item.answer, add_special_tokens=False)["input_ids"])


def _decode_answer(tokenizer: PreTrainedTokenizerBase, new_ids: list[int]) -> str | None:
    """The text before the first EOS, or None when the model never stopped."""
    eos_id = tokenizer.eos_token_id
    if eos_id not in new_ids:
        return None
    return str(tokenizer.decode(new_ids[: new_ids.index(eos_id)]))


@torch.no_grad()
def exact_match(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    items: Sequence[Item],
    max_new_tokens: int | None = None,
    batch_size: int = 64,
) -> list[bool]:
    """Per item: does greedy decoding give exactly `answer` followed by EOS?

    `max_new_tokens` defaults, per item, to the answer's token count plus one (room for
    EOS). Works with any causal LM that returns `.logits`, a peft model included.
    """
    prompt_ids = [tokenizer(it.prompt, add_special_tokens=False)["input_ids"] for it in items]
    limits = [max_new_tokens or _answer_tokens(tokenizer, it) + 1 for it in items]
    results = [False] * len(items)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    for idx in by_length(prompt_ids, batch_size):
        ids = torch.tensor([prompt_ids[i] for i in idx], device=device)
        row_limits = torch.tensor([limits[i] for i in idx], device=device)
        new = greedy(model, ids, row_limits, int(tokenizer.eos_token_id)).cpu().tolist()
        for i, row in zip(idx, new, strict=True):
            results[i] = _decode_answer(tokenizer, row) == items[i].answer
    model.train(was_training)
    return results


def scores_by_skill(items: Sequence[Item], correct: Sequence[bool]) -> dict[str, float]:
    """Mean exact match per skill, in the order skills first appear in `items`."""
    hits: dict[str, list[bool]] = defaultdict(list)
    for it, ok in zip(items, correct, strict=True):
        hits[it.skill].append(ok)
    return {name: sum(v) / len(v) for name, v in hits.items()}


def skill_scores(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    skills: Iterable[str],
    n: int = 200,
    seed: int = 0,
) -> dict[str, float]:
    """Greedy exact match on `n` held-out (eval-split) items per skill."""
    items = make_items(skills, n, seed, split="eval")
    return scores_by_skill(items, exact_match(model, tokenizer, items))
