"""`train.ep_degree` (train/distributed/ep_mesh.py): expert parallelism inside groups of a 2-D
DeviceMesh, every other weight and all the LoRA FSDP2-sharded over the whole mesh. Default
tier: 4 forked gloo ranks (dp_shard 2 × ep 2) whose logits and LoRA gradients equal one
process on the global batch (float64), with and without gradient checkpointing; the
refusals. Slow: `moetune train --nproc 4 --strategy ep --set train.ep_degree=2` against one
process."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from test_train_expert_parallel import EXPERTS, _grads, _rel, _tiny_model

WORLD, EP = 4, 2


def _rank(rank: int, store: str, out: str) -> None:
    """One forked gloo rank: one process's reference on the whole batch, then its quarter
    under ep 2 × FSDP2 – the largest relative differences, and what each rank holds."""
    from torch.distributed.tensor import DTensor

    from moetune.engine.expert_parallel import ep_report, shard_experts
    from moetune.train.distributed.ep_mesh import ep_fsdp_mesh, shard_rest

    torch.set_num_threads(1)  # a forked child: one thread
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))  # fmt: skip
    torch.manual_seed(3)
    ids = torch.randint(0, 64, (2 * WORLD, 12))  # the same batch on every rank
    weights = torch.randn(2 * WORLD, 12, 64, dtype=torch.float64)
    want = _grads(_tiny_model(0), ids, weights)
    mine = slice(rank * 2, rank * 2 + 2)
    found: dict[str, Any] = {}
    for checkpointing in (False, True):
        model = _tiny_model(0)
        if checkpointing:  # before fully_shard wraps the layers
            model.gradient_checkpointing_enable({"use_reentrant": False})
        mesh = ep_fsdp_mesh("cpu", EP)
        shard_experts(model, mesh["ep"])
        ignored = shard_rest(model, mesh, model.base_model.model.model.layers)
        got = _grads(model, ids[mine], weights[mine])
        diffs = [_rel(got["logits"], want["logits"][mine])]
        sharded = 0
        for name, grad in got["grads"].items():
            sharded += isinstance(grad, DTensor)
            whole = grad.full_tensor() if isinstance(grad, DTensor) else grad
            diffs.append(_rel(whole * WORLD, want["grads"][name]))  # FSDP2 averages over N
        found[f"checkpointing={checkpointing}"] = max(diffs)
        found["sharded"], found["trainable"] = sharded, len(got["grads"])
        found["ignored"], found["report"] = ignored, ep_report(model)
        found["groups"] = dist.get_process_group_ranks(mesh.get_group("ep"))
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def test_ep_groups_with_fsdp2_equal_one_process(tmp_path):
    """dp_shard 2 × ep 2: tokens exchanged within each pair of ranks, the experts split over
    the pair and replicated over the pairs, everything else FSDP2-sharded 4 ways – logits and
    every LoRA gradient equal one process on the whole batch to 1e-10 (float64)."""
    # fork: the ranks inherit the imported libraries (spawn re-imports them: a minute here)
    mp.start_processes(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD,
                       start_method="fork")  # fmt: skip
    local = EXPERTS // EP
    for rank in range(WORLD):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert found["checkpointing=False"] < 1e-10, found
        assert found["checkpointing=True"] < 1e-10, found
        assert found["sharded"] == found["trainable"] > 0  # every LoRA factor is FSDP2's
        assert found["ignored"] == 2 * 2  # gate_up and down stacks of 2 layers: its own
        group = rank // EP * EP
        assert found["groups"] == [group, group + 1]  # consecutive ranks exchange tokens
        report = found["report"]
        assert report["ranks"] == EP and report["first_expert"] == local * (rank % EP)
        assert report["held_expert_params"] == 2 * local * (16 * 16 + 16 * 8)


@pytest.mark.parametrize(
    ("degree", "world", "experts", "says"),
    [
        (3, 4, 4, "does not divide the 4 ranks"),
        (4, 8, 6, "6 routed experts do not split evenly over 4"),
    ],
)
def test_an_ep_degree_that_does_not_divide_is_refused(degree, world, experts, says):
    from moetune.errors import ConfigError
    from moetune.train.distributed.ep_mesh import check_ep_degree

    with pytest.raises(ConfigError, match=says) as info:
        check_ep_degree(degree, world, experts)
    assert info.value.fix  # one line with its fix


# ---------------------------------------------------------------- the CLI, 4 gloo ranks (slow)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_train_helpers import tiny_run

    return tiny_run(tmp_path_factory.mktemp("ep-fsdp"))


@pytest.mark.slow
@pytest.mark.parametrize(("degree", "checkpointing"), [(2, False), (1, False), (2, True)])
def test_ep_degree_trains_the_loss_curve_and_adapter_of_one_process(tiny, degree, checkpointing):
    """`--nproc 2 --strategy ep` with train.ep_degree (batch 2 a rank) against 1 process
    (batch 4), 3 steps, fp32: every step's loss and the saved adapter to 1e-5, the adapter
    whole. degree 2: one group, its tokens exchanged, the rest FSDP2 over both; degree 1:
    two groups of one rank (each all experts, "dp_shard" 2); gradient checkpointing switched
    on by the trainer after fully_shard. (4 CPU ranks would exceed the 2
    cores the launcher allows here: the 4-rank mesh is the default-tier test above.)"""
    from safetensors.torch import load_file

    from test_train_distributed import _rel_diff, _train, _write
    from test_train_expert_parallel import _losses

    over = {"max_steps": 3, "gradient_checkpointing": checkpointing}
    name = f"epf{degree}-gc{int(checkpointing)}"
    _train(_write(tiny, f"{name}-2", batch_size=2, nproc=2, strategy="ep", ep_degree=degree,
                  **over), log=tiny.root / f"{name}-2.log")  # fmt: skip
    _train(_write(tiny, f"{name}-1", batch_size=4, **over), log=tiny.root / f"{name}-1.log")
    two, one = tiny.root / f"{name}-2", tiny.root / f"{name}-1"
    got, want = _losses(two), _losses(one)
    assert len(got) == len(want) == 3
    assert max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)) < 1e-5
    assert _rel_diff(two, one) < 1e-5
    ran = json.loads((two / "summary.json").read_text())["distributed"]["expert_parallel"]
    local = EXPERTS // degree
    assert [r["first_expert"] for r in ran] == [0, local % EXPERTS]
    assert all(degree * r["expert_bytes_read"] == r["expert_stack_bytes"] for r in ran)
    assert all(bool(r["rows_sent"]) == (degree > 1) for r in ran)  # one rank a group: none
    adapter = load_file(str(two / "adapter" / "adapter_model.safetensors"))
    a = next(v for k, v in adapter.items() if "experts" in k and "lora_A" in k)
    assert a.shape[0] == 4 * EXPERTS  # [r·E, in]: every expert's factors


@pytest.mark.parametrize(
    ("over", "says"),
    [({"nproc": 2, "ep_degree": 3}, "ep_degree 3 does not divide the 2 ranks"),
     ({"nproc": 2, "strategy": "ddp", "ep_degree": 2}, "train.strategy is ddp"),
     ({"nproc": 2, "ep_degree": 2, "ep_placement": "balanced"}, "FSDP2 shards the factors"),
     ({"nproc": 2, "ep_degree": 2, "model__experts_dtype": "nf4"}, "with experts_dtype nf4 yet"),
     ({"nproc": 2, "ep_placement": "balanced", "model__experts_dtype": "int8"}, "quantised"),
     ({"nproc": 2, "ep_placement": "balanced", "routing_every": 0}, "routing_every 0"),
     ({"nproc": 2, "ep_placement": "balanced", "lora__expert_selection": "gate"},
      "lora.expert_selection")],
)  # fmt: skip
def test_ep_degree_and_placement_are_refused_before_any_rank_starts(tiny, tmp_path, monkeypatch,
                                                                    over, says):  # fmt: skip
    """One line and exit 2 from the launcher: no rank started, nothing written."""
    from typer.testing import CliRunner

    from moetune.cli import app
    from moetune.config import dump_config
    from moetune.train import launch
    from test_train_helpers import tiny_cfg

    started: list[Any] = []
    monkeypatch.setattr(launch, "_run_ranks", lambda *a: started.append(a) or 1)
    cfg = tiny_cfg(tiny, tmp_path / "run", **{"strategy": "ep", **over})
    config = tmp_path / "run.yaml"
    config.write_text(dump_config(cfg))
    got = CliRunner().invoke(app, ["train", str(config)])
    line = " ".join(got.output.split())
    assert got.exit_code == 2 and "Traceback" not in got.output, got.output
    assert says in line and "fix:" in line
    assert started == [] and not (tmp_path / "run").exists()


def test_the_plan_holds_a_group_of_experts_and_a_shard_of_the_rest():
    """`plan --strategy ep` with train.ep_degree 2 on 4 devices: E/2 experts a rank (twice
    the E/4 of one group of 4), the rest of the weights and all the LoRA state 1/4."""
    from moetune.model import spec_from_config
    from moetune.model.census import shrunk_config
    from moetune.plan.devices.sharding import per_rank_bytes, run_sizes
    from test_plan_expert_parallel import cfg

    spec = spec_from_config(shrunk_config("qwen3_moe"), "qwen3_moe")  # 4 experts
    sizes = run_sizes(spec, cfg(ep_degree=2))
    got = per_rank_bytes(spec, cfg(ep_degree=2), 4, "ep")
    flat = per_rank_bytes(spec, cfg(), 4, "ep")
    rest = sizes.single["frozen_weights"] - sizes.expert_weights
    assert got["frozen_weights"] == -(-rest // 4) + sizes.expert_weights // 2
    assert flat["frozen_weights"] == rest + sizes.expert_weights // 4
    for name in ("trainable_weights", "optimizer_state"):  # (gradients: 0 in this estimate)
        # ep alone: the experts' share of the LoRA state 1/4 (engine/ep_lora.py), the rest whole
        split = sizes.single[name] - round(sizes.single[name] * sizes.expert_share * 3 / 4)
        assert got[name] == -(-sizes.single[name] // 4) < flat[name] == split


def test_a_balanced_placement_plans_the_experts_lora_state_1_n():
    """Balanced placement moves each rank's sliced LoRA factors with its experts
    (engine/ep_placement.py), so its plan holds the experts' share of the LoRA state 1/N,
    as contiguous ep does: the same bytes a rank, fewer than the whole."""
    from moetune.model import spec_from_config
    from moetune.model.census import shrunk_config
    from moetune.plan.devices.sharding import per_rank_bytes, run_sizes
    from test_plan_expert_parallel import cfg

    spec = spec_from_config(shrunk_config("qwen3_moe"), "qwen3_moe")
    sizes = run_sizes(spec, cfg(ep_placement="balanced"))
    balanced = per_rank_bytes(spec, cfg(ep_placement="balanced"), 4, "ep")
    contiguous = per_rank_bytes(spec, cfg(), 4, "ep")
    assert 0.0 < sizes.expert_share < 1.0
    for name in ("trainable_weights", "optimizer_state"):
        split = sizes.single[name] - round(sizes.single[name] * sizes.expert_share * 3 / 4)
        assert balanced[name] == contiguous[name] == split < sizes.single[name]
