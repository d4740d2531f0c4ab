"""train.grpo.sft_weight: an SFT (NLL) term beside GRPO's policy loss, on the prompt rows
that carry an answer to imitate in a `completion` column.

Exact-match RL has no dense target: on a skill the base already has, it only nudges the
sampled answers, and at a learning rate that teaches a new skill it erodes a fragile old one
(benchmarks/results/grpo-and-methods.md, GRPO on the replayed prompts alone). Replayed rows
with their known answers anchor those skills the way DPO's `sft_weight` does. Rows whose
`completion` is empty or null are RL only. TRL's GRPOTrainer has no such term; this mixin adds it:

    loss = GRPO loss + sft_weight × mean NLL(completion tokens | prompt)

over the completion tokens (and the EOS appended when missing) of the micro-batch's rows
that carry one. TRL repeats each prompt once per generation; a row's answer counts once
per generation batch (its first copy), so the term does not grow with the group size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from moetune.train.errors import DataError

if TYPE_CHECKING:
    from moetune.data import TrainData

SFT_COLUMN = "completion"
_KEYS = ("sft_ids", "sft_mask", "sft_labels")  # carried through TRL's buffered batches


def sft_rows(tok: Any, prompt: Any, completion: Any) -> tuple[list[int], int]:
    """(prompt + completion ids ending in EOS, number of prompt ids), tokenised as the
    rollout tokenises the prompt (plain text, or the chat template with a generation
    prompt, the completion then the assistant's turns)."""
    if isinstance(prompt, str):
        head = list(tok(text=prompt)["input_ids"])
        tail = list(tok(text=completion, add_special_tokens=False)["input_ids"])
        ids = head + tail
    else:
        head = _chat_ids(tok, prompt, add_generation_prompt=True)
        ids = _chat_ids(tok, [*prompt, *completion], add_generation_prompt=False)
    if tok.eos_token_id is not None and ids[-1] != tok.eos_token_id:
        ids.append(tok.eos_token_id)
    return ids, len(head)


def completion_problem(prompts: list[Any], completions: list[Any]) -> str | None:
    """Why the `completion` column cannot be imitated, or None: each one empty, or of its
    prompt's kind (a string for a string prompt, a message list for a conversation)."""
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        kind = str if isinstance(prompt, str) else list
        if completion and not isinstance(completion, kind):
            want = "a string" if kind is str else "a list of messages"
            return f"row {i + 1}: 'completion' must be {want} like its prompt, or empty"
    return None


def check_sft_rows(data: TrainData) -> None:
    """DataError unless every row has a `completion` the term can imitate (or an empty one)."""
    columns = data.columns()
    if SFT_COLUMN not in columns:
        raise DataError(
            f"{data.path}: train.grpo.sft_weight trains on a {SFT_COLUMN!r} column, which "
            f"the rows lack (columns: {', '.join(sorted(columns))})",
            f"give every row a {SFT_COLUMN!r} (empty for RL-only rows), or sft_weight: 0",
        )
    problem = completion_problem(data.column("prompt"), data.column(SFT_COLUMN))
    if problem:
        raise DataError(f"{data.path} {problem}", "fix that row's completion")


def _chat_ids(tok: Any, messages: list[Any], add_generation_prompt: bool) -> list[int]:
    out = tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def sft_batch(tok: Any, rows: list[dict[str, Any]], device: Any) -> dict[str, torch.Tensor]:
    """Right-padded ids, mask and labels (-100 off the completion) for the rows, one per
    row; a row without a completion, or a repeat of an earlier row's prompt, is all -100."""
    seen: set[str] = set()
    encoded: list[tuple[list[int], int]] = []
    for row in rows:
        completion, key = row.get(SFT_COLUMN), repr(row["prompt"])
        if completion and key not in seen:
            seen.add(key)
            encoded.append(sft_rows(tok, row["prompt"], completion))
        else:
            encoded.append(([tok.pad_token_id], 1))  # a placeholder that trains nothing
    width = max(len(ids) for ids, _ in encoded)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for b, (row_ids, start) in enumerate(encoded):
        ids[b, : len(row_ids)] = torch.tensor(row_ids)
        labels[b, start : len(row_ids)] = ids[b, start : len(row_ids)]
        mask[b, : len(row_ids)] = 1
    return {"sft_ids": ids.to(device), "sft_mask": mask.to(device), "sft_labels": labels.to(device)}


def sft_nll(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """Mean NLL over the labelled tokens of the rows that have any; None when none has."""
    keep = (batch["sft_labels"] != -100).any(dim=1)
    if not keep.any():
        return None
    ids, mask, labels = (batch[k][keep] for k in _KEYS)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
    )


class SftTerm:
    """Mixin before a GRPOTrainer class: adds `sft_weight` × the completion NLL to its loss."""

    sft_weight: float = 0.0

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = super()._generate_and_score_completions(inputs)  # type: ignore[misc]
        tok = self.processing_class  # type: ignore[attr-defined]
        return {**out, **sft_batch(tok, inputs, self.accelerator.device)}  # type: ignore[attr-defined]

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:  # fmt: skip
        rest = {k: v for k, v in inputs.items() if k not in _KEYS}  # the buffer is reused
        loss: torch.Tensor = super().compute_loss(  # type: ignore[misc]
            model, rest, return_outputs, num_items_in_batch
        )
        nll = sft_nll(model, inputs) if self.sft_weight and _KEYS[0] in inputs else None
        if nll is None:
            return loss
        training = model.training
        # TRL scales the policy loss for gradient accumulation itself; scale the term alike
        steps = self.current_gradient_accumulation_steps if training else 1  # type: ignore[attr-defined]
        self._metrics["train" if training else "eval"]["sft_nll"].append(nll.item())  # type: ignore[attr-defined]
        return loss + self.sft_weight * nll / steps


def with_sft_term(trainer: type, weight: float) -> type:
    """`trainer` itself for weight 0, else a subclass with the SFT term at `weight`."""
    if not weight:
        return trainer
    return type(f"{trainer.__name__}WithSft", (SftTerm, trainer), {"sft_weight": weight})
