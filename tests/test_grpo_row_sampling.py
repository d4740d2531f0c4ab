"""GRPO's per-completion random streams (train/grpo/row_sampling.py): a completion's tokens
do not depend on how the prompts are split over ranks.

- 2 forked gloo ranks under `train.strategy ep` (experts E/2 a rank, every decoding step an
  all-to-all), 2 left-padded prompts each, sample (temperature 0.7, top-p 0.9) exactly the
  tokens one process samples on all 4 – while the per-process stream (generate's own
  multinomial, same seed) gives rank 1 other tokens;
- the sampler runs after the warpers: with top-k 1 it samples greedy's tokens;
- a generate call that never reached the sampler is refused.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moetune.train.errors import TrainError
from moetune.train.grpo.row_sampling import RowSampler, sampling_rows
from test_train_expert_parallel import _tiny_model

LENGTHS = (3, 6, 5, 4)  # the prompts' lengths: each rank pads its own to its longest
NEW = 8  # tokens sampled a row
SEED, STEP = 11, 3


def _prompts(rows: range) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `rows` of the 4 prompts, left-padded (as TRL pads them) to their own longest."""
    torch.manual_seed(5)
    every = [torch.randint(1, 64, (n,)) for n in LENGTHS]
    width = max(LENGTHS[r] for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, width - LENGTHS[r] :], mask[b, width - LENGTHS[r] :] = every[r], 1
    return ids, mask


def _sample(model: Any, rows: range, per_row: bool = True, **how: Any) -> list[list[int]]:
    """The NEW tokens sampled for `rows` (global rows), per row streams or the process's."""
    ids, mask = _prompts(rows)
    how = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, **how}
    model.eval()
    sampler = RowSampler(SEED, STEP, rows.start, len(rows))
    torch.manual_seed(SEED)  # the per-process stream, as TRL's set_seed leaves it
    with torch.no_grad(), sampling_rows(model, sampler) if per_row else nullcontext():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW,
                             min_new_tokens=NEW, pad_token_id=0, **how)  # fmt: skip
    return out[:, ids.shape[1] :].tolist()


def _rank(rank: int, world: int, store: str, out: str) -> None:
    from moetune.engine.expert_parallel import ep_mesh, shard_experts
    from moetune.train.distributed.ep_generate import sync_generation

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))  # fmt: skip
    model = _tiny_model(0)
    shard_experts(model, ep_mesh("cpu"))
    sync_generation(model)
    mine = range(2 * rank, 2 * rank + 2)
    found = {"per_row": _sample(model, mine), "stream": _sample(model, mine, per_row=False)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def test_two_ep_ranks_sample_the_completions_of_one_process(tmp_path):
    one = _tiny_model(0)
    want = _sample(one, range(4))
    mp.start_processes(_rank, args=(2, str(tmp_path / "store"), str(tmp_path)),
                       nprocs=2, start_method="fork")  # fmt: skip
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert got[0]["per_row"] + got[1]["per_row"] == want  # every token of every row
    assert len({tuple(row) for row in want}) == 4  # the rows did sample different tokens
    assert got[1]["stream"] != want[2:]  # the per-process stream: not one process's tokens


def test_the_sampler_draws_from_the_warped_distribution():
    model = _tiny_model(0)
    greedy = _sample(model, range(4), per_row=False, do_sample=False, temperature=None,
                     top_p=None)  # fmt: skip
    assert _sample(model, range(4), top_k=1) == greedy  # after top-k, not before it
    assert _sample(model, range(4)) != greedy


def test_a_generate_call_that_bypasses_the_sampler_is_refused():
    model = _tiny_model(0)
    sampler = RowSampler(SEED, STEP, 0, 4)
    refused = pytest.raises(TrainError, match="without moetune's per-row sampler")
    with refused, sampling_rows(model, sampler):
        pass  # nothing sampled: as if generate built its chain elsewhere
