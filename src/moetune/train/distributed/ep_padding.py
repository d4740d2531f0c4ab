"""Under `train.strategy ep`, every rank pads its micro-batch to the widest of all ranks'
micro-batches – the width one process gives the same rows.

A collator pads its rows to their own longest, so rank r's micro-batch is narrower than one
process's batch of every rank's rows whenever the longest row is elsewhere. The extra pad
columns change no real token's value, but they change its rounding: attention reduces over
another key length, and the pad tokens are routed too, so an expert's grouped matmul runs
over another number of rows. Measured on the DeepSeek block-FP8 fixture (2 ranks of 2 rows
against one process of 4, fp32, one step): the experts' down_proj gradients differ by 1e-7
relative, and one element of B's gradient that happens to sit near zero (4.2e-9, where the
rest are ~1e-4) differs by 2.4 %. Adam's first step takes g / (|g| + eps): ±1 for every
other element, but for that one, below eps = 1e-8, the update follows g – and that single
element moved the whole factor by 8.7e-5 (relative norm). Padded to one width (the maximum,
one all-reduce of one integer per micro-batch), and with the routing sorted stably (each
expert's rows in token order: experts_lora.route_pairs), the ranks compute one process's
values: 1.8e-7 at most over the adapter after that step (padded, sorted unstably: 3.1e-6;
2 steps more: the experts' 4.5e-7).

Only right-padded token batches are widened: SFT's (input_ids, labels, attention_mask;
TRL's collator, not padding-free) and DPO's (TRL's preference collator: each row's prompt +
chosen, then prompt + rejected, as input_ids, attention_mask and completion_mask, all
right-padded; its per-row reference log-probs have no width and pass through). Another
collator's batch (packing, images, GRPO) is left as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from moetune.train.errors import TrainError

# what a pad column holds per field (input_ids: the collator's pad id)
FILL = {"labels": -100, "attention_mask": 0, "position_ids": 0, "completion_mask": 0}
PER_ROW = {"ref_chosen_logps", "ref_rejected_logps"}  # DPO: one value a row, no width


def pad_alike(trainer: Any) -> Any:
    """On a trainer whose model's experts are placed over ranks, pad every training
    micro-batch to the widest across ranks (a no-op otherwise). Returns the trainer."""
    # lazy: heavy to import (moetune's engine pulls transformers and peft)
    from moetune.engine.expert_parallel import ep_report

    collate, plain = trainer.data_collator, trainer.get_train_dataloader
    if not right_padded(collate) or ep_report(trainer.model) is None:  # no experts placed
        return trainer
    pad_id = collate.pad_token_id

    def get_train_dataloader() -> Any:
        trainer.data_collator = widest(collate, pad_id, trainer.args.device)
        try:
            return plain()
        finally:
            trainer.data_collator = collate

    trainer.get_train_dataloader = get_train_dataloader
    return trainer


def right_padded(collate: Any) -> bool:
    """Whether `collate` is one whose batches `widest` pads: TRL's SFT collator (not
    padding-free) or its DPO preference collator."""
    # lazy: heavy to import (trl)
    from trl.trainer.dpo_trainer import DataCollatorForPreference
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    if isinstance(collate, DataCollatorForLanguageModeling):
        return not collate.padding_free
    return isinstance(collate, DataCollatorForPreference)


def widest(
    collate: Callable[[list[Any]], Any], pad_id: int, device: torch.device | str = "cpu"
) -> Callable[[list[Any]], Any]:
    """`collate`, its batch then right-padded to the widest batch of every rank (a collective:
    every rank collates its training micro-batches in the same order). `device`: the rank's
    own, where its backend reduces (NCCL reduces device tensors only; gloo CPU ones)."""
    fill = {"input_ids": pad_id, **FILL}

    def collated(rows: list[Any]) -> Any:
        batch = collate(rows)
        unknown = sorted(set(batch) - set(fill) - PER_ROW)
        if unknown:
            raise TrainError(
                f"ep pads every rank's micro-batch alike, and the collator made {unknown}",
                "report it: this collator's batches are not padded across ranks yet",
            )
        width = torch.tensor([batch["input_ids"].shape[1]], device=device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX)
        return {k: v if k in PER_ROW else _right_pad(v, int(width), fill[k])
                for k, v in batch.items()}  # fmt: skip

    return collated


def _right_pad(values: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    extra = width - values.shape[1]
    return torch.nn.functional.pad(values, (0, extra), value=fill) if extra else values
