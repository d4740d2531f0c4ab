"""`train.strategy ep` (engine/expert_parallel.py): experts placed E/N a rank, tokens moved by
all_to_all_single over gloo. Default tier: 2 spawned gloo ranks whose gradients (float64,
with and without gradient checkpointing) sum to one process's on the whole batch, and the
launcher's refusals; a router not deterministic across calls, whose checkpointed recompute
replays the forward's routing. Slow: `moetune train --nproc 2 --strategy ep` against one
process – loss curve and adapter, SFT and DPO – and the adapter loaded in plain peft."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import dump_config
from test_train_distributed import (
    _kill_9_after_step_2,
    _moetune,
    _rel_diff,
    _train,
    _wait_released,
    _write,
)
from test_train_helpers import tiny_cfg, tiny_run

EXPERTS = 4  # the tiny Qwen3-MoE of test_train_helpers and of _tiny_model below


def _tiny_model(seed: int) -> Any:
    """A float64 Qwen3-MoE (4 experts, top-2) with random LoRA on attention and the fused
    experts (B not zero: A gets a gradient too), on split LoRA."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from moetune.engine import apply_split_lora

    config = Qwen3MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=EXPERTS, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float64)
    lora = LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )  # fmt: skip
    wrapped = get_peft_model(model, lora)
    apply_split_lora(wrapped)
    return wrapped


def _grads(
    model: Any, ids: torch.Tensor, weights: torch.Tensor, checkpointing: bool = False
) -> dict[str, Any]:
    """A loss summed over tokens (the gradients of the ranks' halves add up), and its LoRA
    gradients."""
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    model.train()
    logits = model(input_ids=ids).logits
    loss = (logits * weights).sum()
    loss.backward()
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = {n: p.grad.clone() for n, p in trained}
    return {"logits": logits.detach(), "grads": grads, "params": {n: p for n, p in trained}}


def _rank(rank: int, world: int, store: str, out: str) -> None:
    """One spawned gloo rank: one process's reference on the whole batch, then ep on its
    half – without and with gradient checkpointing – and the largest relative differences."""
    from moetune.engine.ep_lora import grad_norm, piece_of, shard_lora, whole
    from moetune.engine.expert_parallel import ep_mesh, ep_report, shard_experts

    torch.set_num_threads(1)  # a forked child: one thread, as DataLoader workers (OpenMP)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )  # a hung exchange fails, not waits
    torch.manual_seed(3)
    ids = torch.randint(0, 64, (2 * world, 12))  # the same batch on every rank
    weights = torch.randn(2 * world, 12, 64, dtype=torch.float64)
    reference = _tiny_model(0)
    want = _grads(reference, ids, weights)
    mine = slice(rank * 2, rank * 2 + 2)
    found: dict[str, Any] = {}
    for checkpointing in (False, True):
        model = _tiny_model(0)
        shard_experts(model, ep_mesh("cpu"))
        sliced = shard_lora(model)
        params = dict(model.named_parameters())
        found["start"] = max(_rel(whole(params[n], piece_of(params[n])), want["params"][n])
                             for n in sliced)  # fmt: skip
        got = _grads(model, ids[mine], weights[mine], checkpointing)
        diffs = [_rel(got["logits"], want["logits"][mine])]
        for name, grad in got["grads"].items():
            piece = piece_of(params[name])
            if piece is None:  # replicated: the ranks' shares of the summed loss add up
                dist.all_reduce(grad)
                params[name].grad = grad / world  # as DDP leaves it: their average
            else:  # its experts' only, every rank's tokens in it, scaled by 1/N
                grad = whole(grad, piece) * world
            diffs.append(_rel(grad, want["grads"][name]))
        found[f"checkpointing={checkpointing}"] = max(diffs)
        want_norm = torch.stack([g.norm() for g in want["grads"].values()]).norm() / world
        found["norm"] = _rel(grad_norm(model.parameters(), dist.group.WORLD), want_norm)
        found["report"] = ep_report(model)
        found["held"] = _held(model, reference, sliced)
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def _held(model: Any, reference: Any, sliced: list[str]) -> dict[str, Any]:
    """Expert-LoRA elements this rank holds and AdamW keeps state for (one step), the
    whole's on one process, and the checkpoint's optimizer state: gathered whole, then cut
    back to this rank's slice (what --resume loads)."""
    from moetune.train.distributed.ep_state import cut_state, whole_optimizer_state

    whole = dict(reference.named_parameters())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    optimizer.step()
    saved = whole_optimizer_state(optimizer)  # a collective, as a checkpoint's save
    params = dict(model.named_parameters())
    state = [optimizer.state[params[n]] for n in sliced]
    order = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    indices = [order[id(params[n])] for n in sliced]
    back = cut_state(optimizer, saved)["state"]
    return {
        "factors": sum(params[n].numel() for n in sliced),
        "whole": sum(whole[n].numel() for n in sliced),
        "moments": sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel() for s in state),
        "saved": sum(saved["state"][i]["exp_avg"].numel() for i in indices),
        "cut_back": max(
            float((back[i][k] - s[k]).abs().max())
            for i, s in zip(indices, state, strict=True)
            for k in ("exp_avg", "exp_avg_sq")
        ),
    }


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


@pytest.mark.parametrize("world", [2, 4])
def test_ep_ranks_gradients_sum_to_one_process(tmp_path, world):
    """Tokens dispatched to their experts' ranks and combined back (uneven splits), in
    forward, backward and the checkpointed recompute: every LoRA gradient summed over the
    ranks, and each rank's logits, equal one process on the whole batch (float64)."""
    # fork: the ranks inherit the imported libraries (spawn re-imports them: a minute here)
    mp.start_processes(_rank, args=(world, str(tmp_path / "store"), str(tmp_path)),
                       nprocs=world, start_method="fork")  # fmt: skip
    local = EXPERTS // world
    for rank in range(world):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert found["checkpointing=False"] < 1e-12
        assert found["checkpointing=True"] < 1e-12
        assert found["start"] == 0  # its slices gather into the factors one process starts with
        assert found["norm"] < 1e-12  # the whole gradient's norm: every rank clips alike
        held = found["held"]  # a layer: gate_up's A and B and down's in-side 16×(r·E = 16), out 8
        assert held["whole"] == 2 * (3 * 16 * 16 + 16 * 8)
        assert world * held["factors"] == held["whole"]  # 1/N of every expert's LoRA
        assert world * held["moments"] == 2 * held["whole"]  # and of AdamW's two moments
        assert held["saved"] == held["whole"] and held["cut_back"] == 0  # a checkpoint's: whole
        report = found["report"]
        assert (report["experts_per_rank"], report["first_expert"]) == (local, local * rank)
        assert report["rows_sent"] > 0 and report["rows_received"] > 0  # tokens did travel
        # its experts' stacks only, in each of 2 layers: gate_up [16, 16], down [16, 8] each
        assert report["held_expert_params"] == 2 * local * (16 * 16 + 16 * 8)
        assert report["held_expert_lora_params"] == held["factors"]  # as summary.json says


def _noisy_router(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Qwen3-MoE's router with noise that changes with every call (the recompute is a call):
    the same function of a token's logits on every rank, so ranks and one process agree."""
    calls = self.__dict__.setdefault("_calls", [0])
    calls[0] += 1
    logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    logits = logits + 0.5 * torch.sin(2.3 * calls[0] + 40 * logits.detach())
    probs = logits.softmax(dim=-1, dtype=torch.float)
    top, indices = torch.topk(probs, self.top_k, dim=-1)
    if self.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), indices


def _replayed_grads(model: Any, ids: torch.Tensor, weights: torch.Tensor) -> dict[str, Any]:
    """Checkpointed gradients with the recompute replaying the forward's routing."""
    from moetune.train.distributed.ep_replay import RecomputeReplay

    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    replay = RecomputeReplay(gates, EXPERTS, 2)
    found = _grads(model, ids, weights, checkpointing=True)
    return {**found, "rerouted": replay.rerouted, "pending": replay.pending()}


def _noisy_rank(rank: int, world: int, store: str, out: str) -> None:
    """One gloo rank, a router that is not deterministic across calls, checkpointed with the
    recompute replay: ep on this rank's half against one process (same replay) on the whole."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    from moetune.engine.expert_parallel import ep_mesh, shard_experts

    torch.set_num_threads(1)
    modeling_qwen3_moe.Qwen3MoeTopKRouter.forward = _noisy_router  # a forked child's own
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))  # fmt: skip
    torch.manual_seed(3)
    ids = torch.randint(0, 64, (2 * world, 12))
    weights = torch.randn(2 * world, 12, 64, dtype=torch.float64)
    want = _replayed_grads(_tiny_model(0), ids, weights)
    model, mine = _tiny_model(0), slice(rank * 2, rank * 2 + 2)
    shard_experts(model, ep_mesh("cpu"))
    got = _replayed_grads(model, ids[mine], weights[mine])
    diffs = [_rel(got["logits"], want["logits"][mine])]
    for name, grad in got["grads"].items():
        dist.all_reduce(grad)
        diffs.append(_rel(grad, want["grads"][name]))
    found = {"diff": max(diffs), **{k: got[k] for k in ("rerouted", "pending")}}
    Path(out, f"rank{rank}.json").write_text(json.dumps({**found, "one": want["rerouted"]}))
    dist.destroy_process_group()


def test_ep_recompute_replays_the_forwards_routing(tmp_path):
    """A router whose choice changes between forward and the checkpointed recompute: the
    recompute sends every token to its forward experts, so 2 ep ranks' gradients still sum
    to one process's with the same replay (float64), and no forward choice is left over."""
    mp.start_processes(_noisy_rank, args=(2, str(tmp_path / "store"), str(tmp_path)),
                       nprocs=2, start_method="fork")  # fmt: skip
    for rank in range(2):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert found["diff"] < 1e-12, found
        assert found["rerouted"] > 0 and found["one"] > 0  # the noise did move tokens
        assert found["pending"] == 0


def test_a_second_forward_before_the_recompute_is_refused():
    """Two training forwards before one backward: which recomputes first is autograd's
    choice, so the replay refuses rather than maybe hand a pass the other's routing."""
    from moetune.train.distributed.ep_replay import RecomputeReplay
    from moetune.train.errors import TrainError

    model = _tiny_model(0)
    RecomputeReplay([m for n, m in model.named_modules() if n.endswith("mlp.gate")], EXPERTS, 2)
    model.gradient_checkpointing_enable({"use_reentrant": False})
    model.train()
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids).logits.sum().backward()  # forward then backward: replayed, fine
    model(input_ids=ids)
    with pytest.raises(TrainError, match="second training forward"):
        model(input_ids=ids)


# ---------------------------------------------------------------- refused in the launcher


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("ep"))


def _dense(root: Path) -> Path:
    """A tiny dense Qwen3 (no routed experts), saved by transformers."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from moetune.demo.tokenizer import build_tokenizer

    tok = build_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tok), hidden_size=16, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    )  # fmt: skip
    Qwen3ForCausalLM(config).save_pretrained(root / "dense")
    tok.save_pretrained(root / "dense")
    return root / "dense"


@pytest.mark.parametrize(
    ("over", "says"),
    [({"nproc": 3}, "do not split evenly over 3 ranks"),
     ({"nproc": 8}, "8 expert-parallel ranks for 4 routed experts"),
     ({"nproc": 2, "lora__engine": "peft"}, "resolves lora.engine to peft"),
     ({"nproc": 2, "tuning": "full"}, "train.tuning full"),
     ({"nproc": 2, "dense": True}, "has none")],
)  # fmt: skip
def test_ep_is_refused_before_any_rank_starts(tiny, tmp_path, monkeypatch, over, says):
    """One line and exit 2 from the launcher: no rank started, nothing written."""
    from moetune.train import launch

    started: list[Any] = []
    monkeypatch.setattr(launch, "_run_ranks", lambda *a: started.append(a) or 1)
    over = dict(over)
    dtype, dense = over.pop("experts_dtype", "bf16"), over.pop("dense", False)
    cfg = tiny_cfg(tiny, tmp_path / "run", **over)
    cfg.model.experts_dtype = dtype  # type: ignore[assignment]
    if dense:
        cfg.model.id = str(_dense(tmp_path))
    config = tmp_path / "run.yaml"
    config.write_text(dump_config(cfg))
    got = CliRunner().invoke(app, ["train", str(config), "--strategy", "ep"])
    line = " ".join(got.output.split())
    assert got.exit_code == 2 and "Traceback" not in got.output, got.output
    assert says in line and "fix:" in line
    assert started == [] and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("over", "gpus"), [({"nproc": 3}, 3), ({"nproc": 8}, 8), ({"nproc": 4, "ep_degree": 3}, 4)]
)
def test_the_launcher_refuses_an_ep_split_in_the_plans_words(tiny, tmp_path, over, gpus):
    """One decision (config/ep_split.py): `train --strategy ep` and `plan --strategy ep`
    give the same cause and fix for the same model and world."""
    from moetune.errors import ConfigError
    from moetune.model import load_spec
    from moetune.plan.devices.sharding import plan_devices
    from moetune.train.distributed.ep_checks import check_expert_parallel

    cfg = tiny_cfg(tiny, tmp_path / "run", strategy="ep", **over)
    with pytest.raises(ConfigError) as launcher:
        check_expert_parallel(cfg)
    with pytest.raises(ConfigError) as plan:
        plan_devices(load_spec(cfg.model.id), cfg, "H100-80GB", gpus, "ep")
    assert (launcher.value.cause, launcher.value.fix) == (plan.value.cause, plan.value.fix)


# ---------------------------------------------------------------- 2 gloo ranks (slow)


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_ep_trains_the_loss_curve_and_adapter_of_one_process(tiny, checkpointing):
    """fp32, 4 steps: 2 ep ranks (batch 2 each) against 1 process (batch 4) – every step's
    loss and the saved adapter to 1e-5; the adapter whole, in peft's layout, and it loads in
    plain peft with the logits of the merged-by-hand reference."""
    over = {"max_steps": 4, "gradient_checkpointing": checkpointing}
    name = f"ep-gc{int(checkpointing)}"
    _train(_write(tiny, f"{name}-2", batch_size=2, nproc=2, strategy="ep", **over),
           log=tiny.root / f"{name}-2.log")  # fmt: skip
    _train(_write(tiny, f"{name}-1", batch_size=4, **over), log=tiny.root / f"{name}-1.log")
    two, one = tiny.root / f"{name}-2", tiny.root / f"{name}-1"
    got, want = _losses(two), _losses(one)
    assert len(got) == len(want) == 4
    assert max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)) < 1e-5
    assert _rel_diff(two, one) < 1e-5
    ran = json.loads((two / "summary.json").read_text())["distributed"]["expert_parallel"]
    assert [r["first_expert"] for r in ran] == [0, 2] and all(r["rows_sent"] for r in ran)
    assert all(2 * r["expert_bytes_read"] == r["expert_stack_bytes"] for r in ran)  # its half
    adapter = load_file(str(two / "adapter" / "adapter_model.safetensors"))
    expert_lora = sum(v.numel() for k, v in adapter.items() if "experts" in k)
    assert all(2 * r["held_expert_lora_params"] == expert_lora for r in ran)  # its experts' only
    a = next(v for k, v in adapter.items() if "experts" in k and "lora_A" in k)
    assert a.shape[0] == 4 * EXPERTS  # [r·E, in]: every expert's factors, not one rank's
    _assert_loads_in_peft(tiny.model, two / "adapter")


@pytest.mark.slow
def test_ep_dpo_trains_the_loss_curve_and_adapter_of_one_process(tiny):
    """train.method dpo under ep (the reference pass – the adapter disabled – exchanges
    tokens too): 2 ranks (batch 2 each) against 1 process (batch 4), 3 steps, fp32 – every
    step's loss to 1e-5 and the saved adapter to 2e-6: each rank's preference batch padded
    as wide as one process's (ep_padding.py; measured 7.3e-7, 3.6e-6 unpadded)."""
    from test_train_helpers import write_jsonl
    from test_train_methods import preference_rows

    pref = write_jsonl(tiny.root / "pref.jsonl", preference_rows(16))
    over = {"max_steps": 3, "method": "dpo", "data__train_file": str(pref)}
    _train(_write(tiny, "ep-dpo-2", batch_size=2, nproc=2, strategy="ep", **over),
           log=tiny.root / "ep-dpo-2.log")  # fmt: skip
    _train(_write(tiny, "ep-dpo-1", batch_size=4, **over), log=tiny.root / "ep-dpo-1.log")
    two, one = tiny.root / "ep-dpo-2", tiny.root / "ep-dpo-1"
    got, want = _losses(two), _losses(one)
    assert len(got) == len(want) == 3
    assert max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)) < 1e-5
    assert _rel_diff(two, one) < 2e-6


@pytest.mark.slow
def test_ep_resume_after_kill_9_gives_the_uninterrupted_adapter(tiny):
    """2 ep ranks, kill -9 of the launcher after the first checkpoint (step 2), then
    `--resume`: the adapter equals the uninterrupted 2-rank run's (1e-5), and so does
    every loss after the resume. The checkpoint holds the adapter and AdamW's moments
    whole – one process's files – and each rank cuts its own experts' back out."""
    import torch

    over = {"max_steps": 6, "save_steps": 2, "batch_size": 2, "nproc": 2, "strategy": "ep"}
    whole = tiny.root / "ep-uninterrupted"
    _train(_write(tiny, whole.name, **over), log=tiny.root / "ep-uninterrupted.log")
    config = _write(tiny, "ep-killed", **over)
    out, log = tiny.root / "ep-killed", tiny.root / "ep-killed.log"
    _kill_9_after_step_2(_moetune("train", str(config), log=log), out, log)
    _wait_released(out)  # the ranks die with the launcher and free the run dir
    step = out / "checkpoints" / "step-2"
    adapter = load_file(str(step / "adapter_model.safetensors"))
    moments = torch.load(step / "optimizer.pt", weights_only=True)["state"].values()
    assert sum(m["exp_avg"].numel() for m in moments) == sum(t.numel() for t in adapter.values())
    result = _train(config, "--resume", log=tiny.root / "ep-resumed.log")
    assert result["resumed_from_step"] == 2 and result["steps"] == 6
    assert _rel_diff(out, whole) < 1e-5
    got, want = _losses(out)[-4:], _losses(whole)[-4:]  # steps 3-6, after the resume
    assert max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)) < 1e-5


def _assert_loads_in_peft(model_dir: Path, adapter: Path) -> None:
    """Plain PeftModel.from_pretrained on the saved adapter gives the logits of the same
    factors applied by moetune's split LoRA (the live path) on a one-process model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from moetune.engine import apply_split_lora

    ids = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(0))
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter)
    live = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter)
    apply_split_lora(live)
    with torch.no_grad():
        want, got = plain(input_ids=ids).logits, live(input_ids=ids).logits
    assert _rel(got.double(), want.double()) < 1e-5
