"""Generation under `train.strategy ep` (train/distributed/ep_generate.py): GRPO's rollouts
on ranks whose experts are placed E/N a rank. Every decoding step is a collective, so a rank
that finishes first keeps stepping until every rank has finished. 2 forked gloo ranks stop
at different lengths: each rank's tokens equal one process's on its own rows, and every rank
runs the same number of forwards. Without the sync, the rank still generating would wait in
its exchange until the gloo timeout, and the test would fail."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from test_train_expert_parallel import _tiny_model

NEW_TOKENS = (2, 5)  # rank 0 is done after 2 new tokens, rank 1 after 5


def _forwards(model: Any) -> list[int]:
    """A counter of the base model's forward calls."""
    calls = [0]
    model.get_base_model().register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _generate(model: Any, ids: torch.Tensor, new_tokens: int) -> list[list[int]]:
    model.eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out.tolist()


def _rank(rank: int, world: int, store: str, out: str) -> None:
    from moetune.engine.expert_parallel import ep_mesh, shard_experts
    from moetune.train.distributed.ep_generate import sync_generation

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))  # fmt: skip
    torch.manual_seed(5)
    ids = torch.randint(1, 64, (2 * world, 6))
    mine, new = ids[rank * 2 : rank * 2 + 2], NEW_TOKENS[rank]
    want = _generate(_tiny_model(0), mine, new)  # one process, its own rows
    model = _tiny_model(0)
    shard_experts(model, ep_mesh("cpu"))
    sync_generation(model)
    calls = _forwards(model)
    got = _generate(model, mine, new)
    found = {"equal": got == want, "length": len(got[0]), "forwards": calls[0]}
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def test_ep_ranks_generating_different_lengths_step_together(tmp_path):
    mp.start_processes(_rank, args=(2, str(tmp_path / "store"), str(tmp_path)),
                       nprocs=2, start_method="fork")  # fmt: skip
    found = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [f["equal"] for f in found] == [True, True]  # the tokens of one process
    assert [f["length"] for f in found] == [6 + 2, 6 + 5]  # each stopped where it should
    assert [f["forwards"] for f in found] == [5, 5]  # rank 0 kept stepping with rank 1


def test_sync_generation_is_forced_and_idempotent():
    """synced_gpus reaches transformers' generate even when a caller turns it off; wrapping
    twice wraps once."""
    from moetune.train.distributed.ep_generate import sync_generation

    model = _tiny_model(0)
    seen: list[Any] = []
    base = model.get_base_model()
    base.__dict__["generate"] = lambda *a, **k: seen.append(k.get("synced_gpus"))
    assert sync_generation(model) is base and sync_generation(model) is base
    model.generate(input_ids=torch.ones(1, 2, dtype=torch.long), synced_gpus=False)
    assert seen == [True]
