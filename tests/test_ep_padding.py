"""Under `train.strategy ep` a rank's rows go through the model exactly as one process's
(train/distributed/ep_padding.py, engine/experts_lora.py `route_pairs`):

- 2 forked gloo ranks collate rows of other lengths with TRL's SFT collator: each rank's
  micro-batch is exactly its rows of one process's batch – as wide, the same pad id, -100
  labels and 0 mask on the pad columns;
- a batch with a field the padding does not know is refused, not padded half;
- an expert's (token, slot) pairs keep the tokens' order when the routing is sorted, so the
  ranks' rows, received rank after rank, are in one process's order.

The whole effect, slow tier (test_ep_quantized.py): 2 ep ranks over the block-FP8 base, 3
steps, experts' LoRA 5.8e-5 → 4.5e-7 from one process.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moetune.engine.experts_lora import route_pairs
from moetune.train.distributed.ep_padding import widest
from moetune.train.errors import TrainError

PAD = 7
LENGTHS = (3, 4, 9, 5)  # rank 0 holds rows 0-1, rank 1 rows 2-3: the longest is rank 1's


def _collator():
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(pad_token_id=PAD)


def _rows(which: range) -> list[dict[str, list[int]]]:
    return [{"input_ids": list(range(10, 10 + LENGTHS[r]))} for r in which]


def _rank(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))  # fmt: skip
    batch = widest(_collator(), PAD)(_rows(range(2 * rank, 2 * rank + 2)))
    Path(out, f"rank{rank}.json").write_text(json.dumps({k: v.tolist() for k, v in batch.items()}))
    dist.destroy_process_group()


def test_each_ranks_micro_batch_is_its_rows_of_one_processs_batch(tmp_path):
    one = _collator()(_rows(range(4)))  # one process: all four rows, one width (trl imported)
    mp.start_processes(_rank, args=(2, str(tmp_path / "store"), str(tmp_path)),
                       nprocs=2, start_method="fork")  # fmt: skip
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert set(got[0]) == set(one) == {"input_ids", "labels", "attention_mask"}
    for key, want in one.items():
        assert got[0][key] + got[1][key] == want.tolist(), key
    assert one["input_ids"].shape[1] == max(LENGTHS)  # rank 0's rows alone are 4 wide


def _preference(which: range) -> list[dict[str, Any]]:
    """Preference rows as TRL's DPO tokenizes them: the longest (prompt + rejected) is
    rank 1's row 3; the reference log-probs DPO precomputes, one a row."""
    return [{"prompt_ids": [11] * (1 + r), "chosen_ids": [12] * (2 + r % 2),
             "rejected_ids": [13] * (1 + 2 * r), "ref_chosen_logps": -1.0 - r,
             "ref_rejected_logps": -2.0 - r} for r in which]  # fmt: skip


def _dpo_rank(rank: int, world: int, store: str, out: str) -> None:
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))  # fmt: skip
    collate = widest(DataCollatorForPreference(pad_token_id=PAD), PAD)
    batch = collate(_preference(range(2 * rank, 2 * rank + 2)))
    Path(out, f"rank{rank}.json").write_text(json.dumps({k: v.tolist() for k, v in batch.items()}))
    dist.destroy_process_group()


def test_each_ranks_dpo_micro_batch_is_its_rows_of_one_processs_batch(tmp_path):
    """TRL's preference collator stacks each row's prompt + chosen, then prompt + rejected:
    a rank's micro-batch holds its rows of one process's batch – chosen rows then rejected
    rows, as wide (11, where rank 0's alone are 5), the same pad id and 0 in both masks – and
    the reference log-probs pass through as they are."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from moetune.train.distributed.ep_padding import right_padded

    collate = DataCollatorForPreference(pad_token_id=PAD)
    assert right_padded(collate)
    one = collate(_preference(range(4)))
    mp.start_processes(_dpo_rank, args=(2, str(tmp_path / "store"), str(tmp_path)),
                       nprocs=2, start_method="fork")  # fmt: skip
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert set(got[0]) == set(one) == {"input_ids", "attention_mask", "completion_mask",
                                       "ref_chosen_logps", "ref_rejected_logps"}  # fmt: skip
    assert one["input_ids"].shape[1] == 11 and len(got[0]["input_ids"][0]) == 11
    assert collate(_preference(range(2)))["input_ids"].shape[1] == 5  # rank 0's rows alone
    for key, want in one.items():
        rows = want.tolist()
        if want.dim() == 1:  # a value a row
            assert got[0][key] + got[1][key] == rows, key
            continue
        halves = [rows[:4], rows[4:]]  # chosen, rejected
        for rank in range(2):
            mine = [row for half in halves for row in half[2 * rank : 2 * rank + 2]]
            assert got[rank][key] == mine, (key, rank)


def test_a_field_the_padding_does_not_know_is_refused():
    def collate(rows):
        return {"input_ids": torch.ones(1, 3, dtype=torch.long), "pixel_values": torch.ones(1)}

    with pytest.raises(TrainError, match=r"collator made \['pixel_values'\]"):
        widest(collate, PAD)([{}])


def test_each_experts_pairs_keep_the_tokens_order():
    torch.manual_seed(0)
    top_k = torch.randint(0, 4, (2048, 2))  # 4096 pairs, ~1000 per expert: many ties
    route = route_pairs(top_k, torch.rand(2048, 2), 4)
    for expert in range(4):
        pairs = route.perm[route.ids == expert]
        assert bool((pairs.diff() > 0).all()), expert  # token, then slot, ascending
