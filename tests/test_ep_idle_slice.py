"""A rank whose experts no token reaches (engine/ep_lora.py `fill_missing_grads`): 2 forked
gloo ranks, float64, a router that sends every token to experts 0 and 1 (rank 0's) in the
first step, and an expert selection of those two in the third, so rank 1's expert-LoRA
slices get no gradient there. On one process the whole
factor gets one (zero on rank 1's experts) and AdamW steps it: weight decay, moments, step
count. With the zero gradient filled in, each rank's slices step as one process's do; without
it the checkpoint's gather of the whole optimizer state is refused, not left waiting. A rank
that receives no rows still runs the backward's exchanges (expert_parallel._local_experts)."""

from __future__ import annotations

import faulthandler
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from test_ep_placement import _expert_factors, _joined
from test_train_expert_parallel import _rel, _tiny_model

MOMENTS = ("exp_avg", "exp_avg_sq")
KEEP = torch.tensor([True, True, False, False])  # expert selection: rank 0's experts only


def _to_rank_0(_module: Any, _args: Any, output: Any) -> Any:
    """The router's top-2 replaced by experts 0 and 1 for every token (its weights kept)."""
    logits, scores, indices = output
    return logits, scores, torch.arange(indices.shape[-1]).expand_as(indices)


def _starved(*models: Any) -> list[Any]:
    """Every MoE router of `models` routes to rank 0's experts; the hooks' handles."""
    gates = [m.mlp.gate for model in models for m in model.base_model.model.model.layers]
    return [gate.register_forward_hook(_to_rank_0) for gate in gates]


def _select(one: Any, model: Any, keep: torch.Tensor | None) -> None:
    """Split LoRA runs only the `keep` experts' LoRA (expert selection's restriction)."""
    from moetune.engine.experts_lora import train_only

    for net in (one, model):
        for experts in (m for m in net.modules() if hasattr(m, "has_gate")):
            train_only(experts, keep)


def _adamw(params: dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(list(params.values()), lr=0.05, weight_decay=0.1)


def _backward(one: Any, model: Any, ids: torch.Tensor, weights: torch.Tensor, rank: int) -> None:
    """One process on the whole batch (its gradient halved: the mean of the 2 ranks' losses,
    what ep's 1/N scaling trains), ep on this rank's half."""
    mine = slice(rank * 2, rank * 2 + 2)
    for net, rows, scale in ((one, slice(None), 0.5), (model, mine, 1.0)):
        net.zero_grad(set_to_none=True)
        net.train()
        (net(input_ids=ids[rows]).logits * weights[rows]).sum().mul(scale).backward()


def _refused_without_fill(held: dict[str, Any]) -> str:
    """AdamW stepped without the fill (rank 1 skips its slices), then a checkpoint's gather:
    its error line, the factors restored."""
    from moetune.train.distributed.ep_state import whole_optimizer_state
    from moetune.train.errors import TrainError

    kept = {n: p.detach().clone() for n, p in held.items()}
    raw = _adamw(held)
    raw.step()
    try:
        whole_optimizer_state(raw)
        said = ""
    except TrainError as err:
        said = str(err)
    with torch.no_grad():
        for name, p in held.items():
            p.copy_(kept[name])
    return said


def _rank(rank: int, store: str, out: str) -> None:
    from moetune.engine.ep_lora import piece_of, shard_lora, whole
    from moetune.engine.expert_parallel import ep_mesh, shard_experts
    from moetune.train.distributed.ep_state import cut_state, ep_trainer, whole_optimizer_state

    faulthandler.dump_traceback_later(120, exit=True)  # a hung exchange fails the test
    ids, weights, one = _joined(rank, store)
    model = _tiny_model(0)
    shard_experts(model, ep_mesh("cpu"))
    shard_lora(model)
    held, ones = _expert_factors(model), _expert_factors(one)
    want_opt = _adamw(ones)
    trainer = SimpleNamespace(model=model, create_optimizer=lambda: _adamw(held),
                              _save_optimizer_and_scheduler=None,
                              _load_optimizer_and_scheduler=None)  # fmt: skip
    opt = ep_trainer(trainer).create_optimizer()  # as the Trainer makes it: the fill installed
    found: dict[str, Any] = {}
    for step, how in enumerate(("starved", "routed", "selected")):
        hooks = _starved(one, model) if how == "starved" else []
        _select(one, model, KEEP if how == "selected" else None)
        _backward(one, model, ids, weights, rank)
        for hook in hooks:
            hook.remove()
        found[f"no_grad_{step}"] = sum(p.grad is None for p in held.values())
        if step == 0:
            found["refused"] = _refused_without_fill(held)
        want_opt.step()
        opt.step()
        saved = whole_optimizer_state(opt)  # what each checkpoint holds
        want = want_opt.state_dict()["state"]
        pairs = [(saved["state"][i][k], want[i][k]) for i in want for k in MOMENTS]
        found[f"moments_{step}"] = max(_rel(got, ref) for got, ref in pairs)
        found[f"steps_{step}"] = sorted({float(s["step"]) for s in saved["state"].values()})
        found[f"factors_{step}"] = max(_rel(whole(p, piece_of(p)), ones[n].detach())
                                       for n, p in held.items())  # fmt: skip
    back = cut_state(opt, whole_optimizer_state(opt))["state"]  # what --resume loads
    found["cut_back"] = max(float((back[i][k] - s[k]).abs().max())
                            for i, s in opt.state_dict()["state"].items()
                            for k in MOMENTS)  # fmt: skip
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


def test_a_rank_no_token_reached_steps_as_one_process_and_checkpoints(tmp_path):
    """Step 1: every token to rank 0's experts. Rank 1 receives no rows, and its backward
    still runs both exchanges (before, rank 0 waited in the backward's all_to_all for
    ever); its 8 expert-LoRA slices get no gradient; without the fill its AdamW skips them
    and the checkpoint's gather is refused in one line. Step 3: expert selection keeps
    rank 0's experts only – rank 1 runs none of its LoRA (before, split LoRA raised on an
    empty selection). With the fill, after each step the gathered moments and factors equal
    one process's (1e-12; weight decay 0.1, so a skipped step would show), every step
    counted on every slice, and the saved state cuts back to each rank's moments exactly."""
    mp.start_processes(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                       start_method="fork")  # fmt: skip
    for rank in range(2):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for step, idle in enumerate((8, 0, 8)):  # rank 1: 2 layers × 2 stacks × A, B
            assert found[f"no_grad_{step}"] == (idle if rank == 1 else 0), found
        assert "some ranks hold optimizer state" in found["refused"], found
        for step in (0, 1, 2):
            assert found[f"moments_{step}"] < 1e-12, found
            assert found[f"factors_{step}"] < 1e-12, found
            assert found[f"steps_{step}"] == [step + 1.0]
        assert found["cut_back"] == 0.0


def _groups_rank(rank: int, store: str, out: str) -> None:
    """train.ep_degree 2 on 2 ranks (FSDP2 over both), every token to rank 0's experts."""
    from torch.distributed.tensor import DTensor

    from moetune.engine.expert_parallel import shard_experts
    from moetune.train.distributed.ep_mesh import ep_fsdp_mesh, shard_rest
    from test_train_expert_parallel import _grads

    faulthandler.dump_traceback_later(120, exit=True)  # a mismatched reduce-scatter fails
    ids, weights, one = _joined(rank, store)
    hooks = _starved(one)
    want = _grads(one, ids, weights)
    model = _tiny_model(0)
    mesh = ep_fsdp_mesh("cpu", 2)
    shard_experts(model, mesh["ep"])
    shard_rest(model, mesh, model.base_model.model.model.layers)
    hooks += _starved(model)
    got = _grads(model, ids[rank * 2 : rank * 2 + 2], weights[rank * 2 : rank * 2 + 2])
    for hook in hooks:
        hook.remove()
    diffs = [_rel(g.full_tensor() if isinstance(g, DTensor) else g, want["grads"][n] / 2)
             for n, g in got["grads"].items()]  # fmt: skip
    Path(out, f"rank{rank}.json").write_text(json.dumps({"diff": max(diffs)}))
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


def test_expert_groups_reduce_a_gradient_no_token_reached(tmp_path):
    """Under train.ep_degree the expert LoRA is FSDP2's: rank 1's experts get no rows, so
    its backward leaves their factors without a gradient, and FSDP2 reduce-scatters a zero
    for them (set_reduce_scatter_unused_params) – every LoRA gradient equals one process's
    mean to 1e-12 (float64); without it the ranks' reduce-scatters do not match."""
    mp.start_processes(_groups_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                       start_method="fork")  # fmt: skip
    for rank in range(2):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert found["diff"] < 1e-12, found


def test_expert_groups_need_fsdp2_to_reduce_unused_gradients(monkeypatch):
    """A torch whose FSDP2 cannot reduce-scatter zeros for unused parameters: train.ep_degree
    refused in one line (the launcher calls this check before any rank starts)."""
    from torch.distributed.fsdp import FSDPModule

    from moetune.train.distributed.ep_mesh import UNUSED, check_ep_degree
    from moetune.train.errors import TrainError

    check_ep_degree(2, 4, 4)  # this torch has it
    monkeypatch.delattr(FSDPModule, UNUSED)
    with pytest.raises(TrainError, match="ep_degree needs FSDP2's"):
        check_ep_degree(2, 4, 4)


def _unreached_rank(rank: int, store: str, out: str) -> None:
    """train.ep_degree 2 on 2 ranks (FSDP2 over both); layer 0's expert selection keeps
    none of its experts, so no rank runs that layer's expert LoRA; AdamW, weight decay 0.1,
    installed as the Trainer creates it."""
    from torch.distributed.tensor import DTensor

    from moetune.engine.expert_parallel import shard_experts
    from moetune.engine.experts_lora import train_only
    from moetune.train.distributed.ep_mesh import ep_fsdp_mesh, shard_rest
    from moetune.train.distributed.ep_unused import unreached_trainer

    faulthandler.dump_traceback_later(120, exit=True)  # a mismatched collective fails
    ids, weights, one = _joined(rank, store)
    model = _tiny_model(0)
    mesh = ep_fsdp_mesh("cpu", 2)
    shard_experts(model, mesh["ep"])
    shard_rest(model, mesh, model.base_model.model.model.layers)
    for net in (one, model):
        layer = net.base_model.model.model.layers[0]
        for experts in (m for m in layer.modules() if hasattr(m, "has_gate")):
            train_only(experts, torch.zeros(4, dtype=torch.bool))
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    ones = {n: p for n, p in one.named_parameters() if p.requires_grad}
    want_opt = _adamw(ones)
    trainer = SimpleNamespace(model=model, create_optimizer=lambda: _adamw(trained))
    opt = unreached_trainer(trainer).create_optimizer()
    whole = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    found: dict[str, Any] = {}
    for step in range(2):
        _backward(one, model, ids, weights, rank)
        found[f"no_grad_one_{step}"] = sorted(n for n, p in ones.items() if p.grad is None)
        want_opt.step()
        opt.step()
        found[f"no_grad_{step}"] = sorted(n for n, p in trained.items() if p.grad is None)
        found[f"factors_{step}"] = max(_rel(whole(p.detach()), ones[n].detach())
                                       for n, p in trained.items())  # fmt: skip
        states = {n: opt.state[p] for n, p in trained.items() if opt.state[p]}
        wants = {n: want_opt.state[p] for n, p in ones.items() if want_opt.state[p]}
        found[f"stateless_{step}"] = [sorted(set(trained) - set(states)),
                                      sorted(set(ones) - set(wants))]  # fmt: skip
        found[f"moments_{step}"] = max(_rel(whole(states[n][k]), wants[n][k])
                                       for n in wants for k in MOMENTS)  # fmt: skip
        found[f"steps_{step}"] = sorted({float(s["step"]) for s in states.values()})
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


def test_expert_groups_skip_a_factor_no_rank_reached_as_one_process(tmp_path):
    """Under train.ep_degree FSDP2 reduce-scatters a zero for a factor this rank's backward
    left without a gradient. Where no rank's backward reached it (layer 0's expert
    selection keeps none), one process's gradient is None and AdamW skips it; the zero
    would decay it (weight decay 0.1) and start its moments. ep_unused.py sets it back to
    None: after 2 steps the factors and AdamW's moments equal one process (float64,
    1e-12), and the same 4 factors (layer 0's experts: 2 stacks × A, B) hold no state."""
    mp.start_processes(_unreached_rank, args=(str(tmp_path / "store"), str(tmp_path)),
                       nprocs=2, start_method="fork")  # fmt: skip
    for rank in range(2):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for step in range(2):
            skipped = found[f"no_grad_one_{step}"]
            assert len(skipped) == 4 and all("layers.0.mlp.experts" in n for n in skipped)
            assert found[f"no_grad_{step}"] == skipped, found
            assert found[f"stateless_{step}"] == [skipped, skipped], found
            assert found[f"factors_{step}"] < 1e-12, found
            assert found[f"moments_{step}"] < 1e-12, found
            assert found[f"steps_{step}"] == [step + 1.0]
