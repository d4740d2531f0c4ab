"""`train.ep_placement: balanced` (engine/ep_placement.py): experts bin-packed by the base's
measured routing, each rank's group laid out contiguously. Default tier: the bin-packing's
figures; 2 forked gloo ranks with a non-contiguous placement, each holding its experts' LoRA
slices, whose logits, LoRA gradients and one AdamW step equal one process (float64), whose
factors and moments gather whole in the base's order and cut back exactly. Slow: `moetune
train --nproc 2 --strategy ep` balanced against one process."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from test_train_expert_parallel import _grads, _rel, _tiny_model

ORDERS = [(3, 0, 2, 1), (1, 2, 0, 3)]  # per layer: rank 0 holds experts {0, 3} / {1, 2}


def test_balanced_groups_even_out_a_skewed_layer():
    """Loads 10, 9, 1, 1 on 2 ranks: contiguous puts 19 rows on rank 0 and 2 on rank 1;
    the bin-packing 11 and 10, and every expert exactly once, E/N a rank."""
    from moetune.engine.ep_placement import balanced_groups, rank_loads

    loads = [10, 9, 1, 1]
    groups = balanced_groups(loads, 2)
    assert groups == [[0, 3], [1, 2]]
    assert rank_loads(loads, [0, 1, 2, 3], 2) == [19, 2]
    assert rank_loads(loads, [e for g in groups for e in g], 2) == [11, 10]
    many = [((7 * e) % 13) ** 2 for e in range(16)]  # 16 experts, 4 ranks
    placed = balanced_groups(many, 4)
    assert sorted(e for g in placed for e in g) == list(range(16))
    assert {len(g) for g in placed} == {4}
    got = rank_loads(many, [e for g in placed for e in g], 4)
    assert max(got) - sum(many) / 4 <= max(many)  # the greedy bound: one expert over the mean


def _placed(model: Any) -> list[Any]:
    """ep over 2 ranks, each rank's expert LoRA sliced, each layer's experts in its ORDERS
    entry."""
    from moetune.engine.ep_lora import shard_lora
    from moetune.engine.ep_placement import place
    from moetune.engine.expert_parallel import _SHARD, ep_mesh, shard_experts

    shard_experts(model, ep_mesh("cpu"))
    shard_lora(model)
    layers = [m for m in model.modules() if _SHARD in m.__dict__]
    for experts, order in zip(layers, ORDERS, strict=True):
        place(experts, order)
    return layers


def _expert_factors(model: Any) -> dict[str, Any]:
    return {n: p for n, p in model.named_parameters() if "experts" in n and "lora_" in n}


def _joined(rank: int, store: str) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """This forked rank in a 2-rank gloo group; the batch and the one-process model every
    rank builds alike (same seeds)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))  # fmt: skip
    torch.manual_seed(3)
    ids = torch.randint(0, 64, (4, 12))
    weights = torch.randn(4, 12, 64, dtype=torch.float64)
    return ids, weights, _tiny_model(0)


def _one_step(factors: dict[str, Any], scale: float) -> torch.optim.Optimizer:
    """One AdamW step on the expert LoRA factors, their gradients times `scale`."""
    for p in factors.values():
        p.grad = p.grad * scale
    optimizer = torch.optim.AdamW(list(factors.values()), lr=0.05, weight_decay=0.1)
    optimizer.step()
    return optimizer


def _rank(rank: int, store: str, out: str) -> None:
    """One forked gloo rank: one process on the whole batch; ep on its half, balanced, its
    expert LoRA sliced; then one AdamW step on the expert LoRA on both."""
    from moetune.engine.ep_lora import part_of, piece_of, whole
    from moetune.train.distributed.ep_state import whole_optimizer_state, whole_trainable

    ids, weights, one = _joined(rank, store)
    saved = {k: v.detach().clone() for k, v in _expert_factors(one).items()}
    want = _grads(one, ids, weights)
    model, mine = _tiny_model(0), slice(rank * 2, rank * 2 + 2)
    layers = _placed(model)
    held = _expert_factors(model)
    found: dict[str, Any] = {"held": [experts.gate_up_proj.shape[0] for experts in layers],
                             "factors": [sum(p.numel() for p in held.values()),
                                         sum(p.numel() for p in saved.values())]}  # fmt: skip
    state = whole_trainable(model)  # gathered: the base's order
    found["state"] = max(_rel(state[k], saved[k]) for k in saved)
    found["cut_back"] = max(_rel(part_of(saved[k], piece_of(p)), p) for k, p in held.items())
    got = _grads(model, ids[mine], weights[mine])
    diffs = [_rel(got["logits"], want["logits"][mine])]
    for name, grad in got["grads"].items():
        piece = piece_of(dict(model.named_parameters())[name])
        if piece is None:
            dist.all_reduce(grad)
        else:  # its experts' only, every rank's tokens, scaled by 1/N (ep_lora.py)
            grad = whole(grad, piece) * 2
        diffs.append(_rel(grad, want["grads"][name]))
    found["diff"] = max(diffs)
    ones = _one_step(_expert_factors(one), 0.5)  # the 1/N: one process's step on the mean
    mine_opt = _one_step(held, 1.0)
    after = whole_trainable(model)
    found["stepped"] = max(_rel(after[k], p) for k, p in _expert_factors(one).items())
    moments = whole_optimizer_state(mine_opt)["state"]
    want_moments = ones.state_dict()["state"]
    found["moments"] = max(_rel(moments[i][k], want_moments[i][k])
                           for i in want_moments for k in ("exp_avg", "exp_avg_sq"))  # fmt: skip
    with torch.no_grad():
        again, ref = model(input_ids=ids[mine]).logits, one(input_ids=ids).logits[mine]
    found["relogits"] = _rel(again, ref)
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def test_balanced_placement_equals_one_process(tmp_path):
    """Rank 0 holds experts {3, 0} then {1, 2}, rank 1 the others (stacks and LoRA slices
    moved by all_to_all_single): each rank holds half the expert LoRA; logits and every LoRA
    gradient equal one process to 1e-12; the factors gather whole in the base's order and
    cut back bit for bit; after an AdamW step the gathered factors, both moments and the
    logits equal one process's (float64)."""
    mp.start_processes(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                       start_method="fork")  # fmt: skip
    for rank in range(2):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert found["held"] == [2, 2]
        assert 2 * found["factors"][0] == found["factors"][1]  # 1/N of the expert LoRA
        assert found["diff"] < 1e-12, found
        assert found["state"] == 0.0 and found["cut_back"] == 0.0  # bit for bit
        assert found["stepped"] < 1e-12 and found["moments"] < 1e-12, found
        assert found["relogits"] < 1e-12


def test_whole_factors_are_not_placed():
    """place() moves sliced LoRA factors with their experts; whole ones (shard_lora not
    run) would keep the base's order while the experts move: refused before anything moves."""
    from moetune.engine.ep_placement import place
    from moetune.engine.expert_parallel import _SHARD, ExpertShard
    from moetune.engine.experts_lora import EngineError

    experts = next(m for m in _tiny_model(0).modules() if hasattr(m, "gate_up_proj"))
    experts.__dict__[_SHARD] = ExpertShard(None, 2, 0, 4)
    before = experts.gate_up_proj.detach().clone()
    with pytest.raises(EngineError, match="these are whole"):
        place(experts, [3, 0, 2, 1])
    assert torch.equal(experts.gate_up_proj, before)


def test_a_stack_loaded_for_another_world_is_refused():
    """A stack ep_load read for another world (3 experts where 2 ranks hold 2 each): one
    check for float and quantised stacks alike."""
    from moetune.engine.expert_parallel import ExpertShard, _check_loaded
    from moetune.engine.experts_lora import EngineError

    with pytest.raises(EngineError, match="loaded with 3 experts a rank, and 2 ranks hold 2"):
        _check_loaded({"down_proj": torch.zeros(3, 2, 2)}, ExpertShard(None, 2, 0, 4))


def test_a_placement_must_name_every_expert_once():
    from moetune.engine.ep_placement import place
    from moetune.engine.expert_parallel import _SHARD, ExpertShard
    from moetune.engine.experts_lora import EngineError

    experts = next(m for m in _tiny_model(0).modules() if hasattr(m, "gate_up_proj"))
    experts.__dict__[_SHARD] = ExpertShard(None, 2, 0, 4)
    with pytest.raises(EngineError, match="each of the 4 experts once"):
        place(experts, [0, 0, 1, 2])


@pytest.mark.parametrize(
    ("placement", "says"), [("contiguous", "contiguous groups"), ("balanced", "measured routing")]
)
def test_the_plan_states_the_skew_each_placement_assumes(placement, says):
    """`plan --strategy ep`: the per-rank plan's note and the EP figure name the placement
    and the skew it assumes."""
    from moetune.model import spec_from_config
    from moetune.model.census import shrunk_config
    from moetune.plan.devices.sharding import device_report
    from test_plan_expert_parallel import cfg

    spec = spec_from_config(shrunk_config("qwen3_moe"), "qwen3_moe")
    report = device_report(spec, cfg(ep_placement=placement), ["H100-80GB"], 2, "ep")
    doc = report.to_json()["expert_parallel"]
    assert doc["placement"] == placement and says in doc["skew_statement"]
    notes = report.plans["H100-80GB"].notes
    assert sum(says in n for n in notes) == 1  # stated once, for this placement


# ---------------------------------------------------------------- the CLI, 2 gloo ranks (slow)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_train_helpers import tiny_run

    return tiny_run(tmp_path_factory.mktemp("ep-balanced"))


@pytest.mark.slow
def test_balanced_placement_trains_the_adapter_of_one_process(tiny):
    """`--nproc 2 --strategy ep` with train.ep_placement balanced (batch 2 a rank) against 1
    process (batch 4), 3 steps, fp32: every step's loss and the saved adapter to 1e-5, each
    rank holding half the expert LoRA, the router unchanged, the adapter in the base's order
    (it loads in plain peft); the placement evens out the measured rows per rank."""
    from safetensors.torch import load_file

    from test_train_distributed import _rel_diff, _train, _write
    from test_train_expert_parallel import _assert_loads_in_peft, _losses

    over = {"max_steps": 3}
    got = _train(_write(tiny, "bal-2", batch_size=2, nproc=2, strategy="ep",
                        ep_placement="balanced", **over), log=tiny.root / "bal-2.log")  # fmt: skip
    _train(_write(tiny, "bal-1", batch_size=4, **over), log=tiny.root / "bal-1.log")
    two, one = tiny.root / "bal-2", tiny.root / "bal-1"
    losses, want = _losses(two), _losses(one)
    assert len(losses) == len(want) == 3
    assert max(abs(g - w) / abs(w) for g, w in zip(losses, want, strict=True)) < 1e-5
    assert _rel_diff(two, one) < 1e-5
    assert got["router_changed"] is False
    placed = json.loads((two / "ep_placement.json").read_text())
    for layer, rows in placed["rows_per_rank"].items():  # this base: 392 -> 347, 418 -> 383
        assert max(rows["balanced"]) < max(rows["contiguous"]), layer
        assert sorted(placed["orders"][layer]) != placed["orders"][layer]  # stacks did move
    ran = json.loads((two / "summary.json").read_text())["distributed"]["expert_parallel"]
    assert {r["placement"] for r in ran} == {"balanced"}
    adapter = load_file(str(two / "adapter" / "adapter_model.safetensors"))
    expert_lora = sum(v.numel() for k, v in adapter.items() if "experts" in k)
    assert all(2 * r["held_expert_lora_params"] == expert_lora for r in ran)  # its experts' only
    _assert_loads_in_peft(tiny.model, two / "adapter")


# ---------------------------------------------------------------- expert selection under ep

KEEP = [torch.tensor([True, False, False, True]), torch.tensor([False, True, True, True])]


def _kept(model: Any) -> list[Any]:
    """Only the KEEP experts' LoRA runs, per layer (what restrict_training asks of split LoRA)."""
    from moetune.engine.experts_lora import train_only

    layers = [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "has_gate")]
    for experts, keep in zip(layers, KEEP, strict=True):
        train_only(experts, keep)
    return layers


def _select_rank(rank: int, store: str, out: str) -> None:
    """One forked gloo rank: selected experts under ep against one process, same selection."""
    from moetune.engine.expert_parallel import ep_mesh, shard_experts

    ids, weights, one = _joined(rank, store)
    _kept(one)
    want = _grads(one, ids, weights)
    model, mine = _tiny_model(0), slice(rank * 2, rank * 2 + 2)
    shard_experts(model, ep_mesh("cpu"))
    _kept(model)
    got = _grads(model, ids[mine], weights[mine])
    diffs, idle = [_rel(got["logits"], want["logits"][mine])], 0.0
    for name, grad in got["grads"].items():
        dist.all_reduce(grad)
        diffs.append(_rel(grad, want["grads"][name]))
        if "experts" in name and "lora_A" in name:  # [r·E, in]: the unselected experts' rows
            keep = KEEP[int(name.split("layers.")[1].split(".")[0])]
            idle = max(idle, float(grad.view(4, -1)[~keep].abs().max()))
    found = {"diff": max(diffs), "idle": idle}
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def test_selected_experts_train_under_ep_as_on_one_process(tmp_path):
    """lora.expert_selection's split-LoRA restriction under ep: each rank runs the LoRA of
    the selected experts it holds (layer 0: experts 0 and 3 – one on each rank); logits and
    LoRA gradients equal one process with the same selection to 1e-12 (float64), and the
    unselected experts' factors get exactly no gradient."""
    mp.start_processes(_select_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                       start_method="fork")  # fmt: skip
    for rank in range(2):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert found["diff"] < 1e-12, found
        assert found["idle"] == 0.0
