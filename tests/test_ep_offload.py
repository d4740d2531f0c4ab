"""`train.offload` under `train.strategy ep` (engine/offload/load.py's `part`): each rank's
ExpertStore holds only its own experts – read from the safetensors as partitioned (every
stored buffer cut by StackFiles.part, float stacks by stack_files.expert_part), NF4
quantised for its experts only – and streams them layer by layer. Forked 2 gloo ranks, for
offload cpu and disk over a float base, NF4 experts and DeepSeek's block-FP8 release: logits
and every LoRA gradient summed over the ranks equal one process without offload (fp32,
1e-5); each rank's store holds exactly half the one-process store's bytes; disk scratch
stays in the rank's own directory. Slow: `moetune train --nproc 2 --strategy ep` with
train.offload disk against one process with offload."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moetune.engine.offload.load import load_offloaded
from moetune.engine.offload.store import offloaded_of
from test_ep_quantized import (
    _grads,
    _load,
    _rank_diffs,
    _wrapped,
    bases,  # noqa: F401  (the module-scoped fixture)
)
from test_stored_fp8_deepseek import deepseek  # noqa: F401  (the fixture bases reads)

pytestmark = pytest.mark.filterwarnings("ignore")
WORLD, EXPERTS = 2, 4
MODULES = {"float": ["q_proj", "v_proj"], "nf4": ["q_proj", "v_proj"], "fp8": ["o_proj"]}


def _reference(kind: str, base: Path) -> Any:
    """One process, nothing offloaded: the whole base as moetune loads it without offload."""
    from transformers import AutoModelForCausalLM

    if kind == "float":
        return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return _load(kind, base, None, WORLD)


def _offloaded(kind: str, base: Path, mode: str, rank: int | None, scratch: Path) -> Any:
    """The base with its experts in a store: this rank's (`rank`) or all of them."""
    part = None if rank is None else (rank, WORLD)
    model, store, _ = load_offloaded(
        base, mode, "cpu", torch.float32, experts_dtype="nf4" if kind == "nf4" else "bf16",
        scratch_dir=scratch, stored=kind == "fp8", part=part,
    )  # fmt: skip
    return model, store


def _rank(rank: int, paths: dict[str, str], out: str) -> None:
    """Per kind and mode: this rank's offloaded experts on its half of the batch."""
    from moetune.engine.expert_parallel import ep_mesh, shard_experts

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=120))  # fmt: skip
    found: dict[str, Any] = {}
    for kind, base in paths.items():
        torch.manual_seed(3)
        ids = torch.randint(0, 40, (2 * WORLD, 12))
        one = _wrapped(_reference(kind, Path(base)), MODULES[kind])
        weights = torch.randn(2 * WORLD, 12, one.config.vocab_size)
        want = _grads(one, ids, weights)
        for mode in ("cpu", "disk"):
            scratch = Path(out, f"scratch-{kind}-{mode}", f"rank{rank}")
            scratch.mkdir(parents=True)
            whole = _offloaded(kind, Path(base), mode, None, Path(out))[1].stats.stored_bytes
            model, store = _offloaded(kind, Path(base), mode, rank, scratch)
            model = _wrapped(model, MODULES[kind])
            shard_experts(model, ep_mesh("cpu"))
            diffs = _rank_diffs(model, ids, weights, want, slice(rank * 2, rank * 2 + 2), WORLD)
            refs = [r for m in model.modules() for r in offloaded_of(m).values()]
            found[f"{kind}-{mode}"] = {
                "diff": max(diffs), "grads": len(diffs) - 1,
                "held": sorted({r.held for r in refs}),
                "shapes": sorted({r.shape[0] for r in refs}),
                "fetched": sorted({r.fetch().shape[0] for r in refs}),
                "stored_bytes": store.stats.stored_bytes, "whole_bytes": whole,
                "backward_bytes": store.stats.bytes_moved["backward"], "layers": store.stats.layers,
                "scratch": sorted(p.name for p in scratch.iterdir()),
            }  # fmt: skip
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def test_ep_ranks_with_offloaded_experts_equal_one_process(bases, tmp_path):  # noqa: F811
    """Offload cpu and disk over a float base, NF4 experts and a stored block-FP8 base, on 2
    ranks: logits and summed LoRA gradients equal one process without offload (fp32, 1e-5);
    each rank's store holds 2 of the 4 experts – half the one-process store's bytes – and
    peft still sees all 4 (the adapter stays whole); NF4 on disk spills to the rank's own dir."""
    paths = {"float": str(bases["float"]), "nf4": str(bases["float"]), "fp8": str(bases["fp8"])}
    mp.start_processes(_rank, args=(paths, str(tmp_path)), nprocs=WORLD, start_method="fork")
    for rank in range(WORLD):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for case, got in found.items():
            assert got["diff"] < 1e-5, (case, got)
            assert got["grads"] >= 8, case  # attention and every expert stack's A and B
            assert got["held"] == got["fetched"] == [EXPERTS // WORLD], case
            assert got["shapes"] == [EXPERTS], case  # what peft sizes the LoRA from
            assert got["stored_bytes"] * WORLD == got["whole_bytes"], case
            # streamed again for the input gradient (one MoE layer stays on the device)
            assert got["backward_bytes"] > 0 or got["layers"] == 1, case
            spilled = case == "nf4-disk"  # float and stored stacks stay in the base's files
            assert len(got["scratch"]) == int(spilled), case


# ---------------------------------------------------------------- the launcher


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_train_helpers import tiny_run

    return tiny_run(tmp_path_factory.mktemp("ep-offload"))


@pytest.mark.parametrize(("over", "says"), [({"ep_degree": 2}, "train.ep_degree")])
def test_offload_that_cannot_reach_the_stores_is_refused_before_any_rank(
    tiny, tmp_path, monkeypatch, over, says
):
    """Offload under ep with FSDP2 expert groups (whose sharding cannot hold the stores'
    stacks): exit 2, one line, no rank started, nothing written. The balanced placement
    is not refused: each store reads its placed experts (test_ep_offload_balanced.py)."""
    from typer.testing import CliRunner

    from moetune.cli import app
    from moetune.config import dump_config
    from moetune.train import launch
    from test_train_helpers import tiny_cfg

    started: list[Any] = []
    monkeypatch.setattr(launch, "_run_ranks", lambda *a: started.append(a) or 1)
    out = tmp_path / "never"
    cfg = tiny_cfg(tiny, out, offload="disk", strategy="ep", nproc=4, **over)
    (tmp_path / "run.yaml").write_text(dump_config(cfg))
    got = CliRunner().invoke(app, ["train", str(tmp_path / "run.yaml")])
    line = " ".join(got.output.split())
    assert got.exit_code == 2 and "Traceback" not in got.output, got.output
    assert f"train.offload=disk with {says}" in line and "train.offload: none" in line, line
    assert started == [] and not out.exists()


def test_each_ranks_disk_scratch_is_a_directory_of_its_own(tiny, tmp_path, monkeypatch):
    """train's load under ep with offload disk and NF4 experts: each global rank spills its
    own quantised experts into .staging/offload/rank<R>/, so two ranks never share a file."""
    from moetune.train.offload import load_offloaded_model, rank_device
    from moetune.train.setup import Placement
    from test_train_helpers import tiny_cfg

    cfg = tiny_cfg(tiny, tmp_path / "run", offload="disk", strategy="ep", nproc=2,
                   lora__engine="moetune", model__experts_dtype="nf4")  # fmt: skip
    scratch, models = tmp_path / "run" / ".staging" / "offload", []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        models.append(load_offloaded_model(cfg, Placement("cpu", "fp32"), torch.float32,
                                           str(tiny.model), scratch, False, (rank, 2)))  # fmt: skip
    assert sorted(p.name for p in scratch.iterdir()) == ["rank0", "rank1"]
    assert [len(list((scratch / f"rank{r}").iterdir())) for r in (0, 1)] == [1, 1]
    held = {r.held for m in models for mod in m.modules() for r in offloaded_of(mod).values()}
    assert held == {EXPERTS // WORLD}
    monkeypatch.setenv("LOCAL_RANK", "1")  # a rank's store streams to the rank's own GPU
    assert (rank_device("cuda"), rank_device("cpu")) == ("cuda:1", "cpu")


# ---------------------------------------------------------------- the plan


@pytest.mark.parametrize("mode", ["cpu", "disk"])
def test_plan_counts_each_ranks_store_as_the_store_holds_it(tiny, mode):
    """The per-rank offload plan under ep against the store a rank really builds (the tiny
    fp32 base, 2 ranks): its offloaded bytes and one layer's are the rank's store's, half one
    process's; the device holds the rest and two layers of its slice; host RAM per node is
    both ranks' processes; on disk each rank reads half the stacks' file bytes per pass."""
    from moetune.config import parse_config
    from moetune.model import load_spec
    from moetune.plan.devices.ep_offload import plan_ep_offload
    from moetune.plan.offload.memory import plan_offload

    cfg = parse_config({"model": {"id": str(tiny.model)}, "lora": {"rank": 4},
                        "train": {"offload": mode, "strategy": "ep", "nproc": 2,
                                  "device": "cpu", "seq_len": 32}})  # fmt: skip
    spec = load_spec(str(tiny.model))
    plan = plan_ep_offload(spec, cfg, None, 2, 2)
    one = plan_offload(spec, cfg, None)
    _, store, _ = load_offloaded(tiny.model, mode, "cpu", torch.float32, part=(1, 2))
    assert plan.offloaded_bytes == store.stats.stored_bytes == one.offloaded_bytes // 2
    assert plan.layer_expert_bytes == store.stats.layer_bytes
    assert plan.device_components["streamed_experts"] == 2 * store.stats.layer_bytes
    assert plan.host_ram_bytes == 2 * plan.device_peak_bytes  # the node's 2 ranks
    rest = one.device_components["resident_weights"]  # the rest, replicated: as one process
    if mode == "disk":
        assert plan.disk_bytes == store.stats.stored_bytes == one.disk_bytes // 2
        assert plan.device_components["resident_weights"] == rest
    else:  # host RAM is the device: the rank's store lives there too
        assert plan.device_components["resident_weights"] == rest - one.offloaded_bytes // 2
    assert sum(plan.bytes_moved_per_step.values()) * 2 == sum(one.bytes_moved_per_step.values())


def test_plan_command_plans_offload_per_rank_under_ep(tiny):
    """`moetune plan --gpus 2 --strategy ep --offload cpu`: the offload plan is one rank's
    (half the one-process store, its note says so); without --gpus it is one process's."""
    from typer.testing import CliRunner

    from moetune.cli import app

    def offload(*flags: str) -> dict[str, Any]:
        got = CliRunner().invoke(app, ["plan", str(tiny.model), "--offload", "cpu", "--json",
                                       "--set", "train.device=cpu", *flags])  # fmt: skip
        assert got.exit_code == 0, got.output
        return json.loads(got.output)["offload"]["cpu"]

    one, rank = offload(), offload("--gpus", "2", "--strategy", "ep")
    assert rank["offloaded_bytes"] * 2 == one["offloaded_bytes"] > 0
    assert rank["pinned_host_bytes"] * 2 == one["pinned_host_bytes"]
    assert any("per rank of 2 under train.strategy ep" in n for n in rank["notes"])


@pytest.mark.parametrize("mode", ["cpu", "disk"])
def test_a_cuda_nodes_host_ram_is_the_sum_of_its_ranks_stores(mode):
    """On H100-80GB, Qwen3-30B-A3B on 2 nodes × 4 ranks (ep 8): each rank pins its 1/8 of
    the experts (cpu) or two layers of its slice (disk), a node holds its 4 ranks' pins and
    host sides; the device holds two layers of the rank's slice, 1/8 of one process's."""
    from moetune.config import parse_config
    from moetune.model import load_spec
    from moetune.plan.devices.ep_offload import plan_offload_of_run
    from moetune.plan.offload.memory import CUDA_HOST_BASELINE, plan_offload

    spec = load_spec("Qwen/Qwen3-30B-A3B")
    cfg = parse_config({"train": {"offload": mode, "strategy": "ep", "nproc": 4, "nnodes": 2}})
    one = plan_offload(spec, cfg, "H100-80GB")
    rank = plan_offload_of_run(spec, cfg, "H100-80GB")
    assert rank.layer_expert_bytes == -(-one.layer_expert_bytes // 8)
    assert rank.device_components["streamed_experts"] == 2 * rank.layer_expert_bytes
    pinned = rank.offloaded_bytes if mode == "cpu" else 2 * rank.layer_expert_bytes
    assert rank.pinned_host_bytes == pinned
    assert rank.host_ram_bytes == 4 * (pinned + CUDA_HOST_BASELINE)
    assert rank.disk_bytes == (-(-one.disk_bytes // 8) if mode == "disk" else 0)


def test_a_part_that_does_not_divide_the_experts_is_refused(tiny):
    from moetune.errors import ConfigError

    with pytest.raises(ConfigError, match="4 routed experts do not split evenly over 3"):
        load_offloaded(tiny.model, "cpu", "cpu", torch.float32, part=(0, 3))


# ---------------------------------------------------------------- the CLI (slow)


@pytest.mark.slow
def test_cli_ep_with_disk_offload_trains_as_one_process_with_offload(tmp_path):
    """`moetune train --nproc 2 --strategy ep` with train.offload disk (each rank streaming
    its 2 of the 4 experts from the base's files) against one process with train.offload
    disk, batch 2 × 2 against 4: every step's loss and the adapter equal (fp32, 1e-5);
    offload.json holds both ranks' stores, each half the experts' bytes."""
    from test_ep_quantized import _two_ranks_and_one
    from test_train_distributed import _rel_diff
    from test_train_helpers import reverse_rows, save_tiny_model, write_jsonl

    base = save_tiny_model(tmp_path / "base")
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(24))
    _two_ranks_and_one(base, data, tmp_path, offload="disk", lora__engine="moetune")
    assert _rel_diff(tmp_path / "two", tmp_path / "one") < 1e-5
    two = json.loads((tmp_path / "two" / "offload.json").read_text())
    one = json.loads((tmp_path / "one" / "offload.json").read_text())
    assert [r["stored_bytes"] * 2 for r in two["ranks"]] == [one["stored_bytes"]] * 2
    assert two["stored_bytes"] == two["ranks"][0]["stored_bytes"]  # the top level: rank 0's
    assert not (tmp_path / "two" / ".staging").exists()  # every rank's scratch cleared
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    planned = summary["memory"]["planned_components"]  # the per-rank plan (ep_offload.py)
    assert [planned["streamed_experts"]] * 2 == [2 * r["layer_bytes"] for r in two["ranks"]]
    for rank in summary["distributed"]["expert_parallel"]:  # peak RSS against that plan
        assert 0.9 < rank["measured_over_planned"] < 1.1, rank


@pytest.mark.slow
def test_cli_ep_with_cpu_offload_over_a_stored_fp8_base(bases, tmp_path):  # noqa: F811
    """`moetune train --nproc 2 --strategy ep` with train.offload cpu over DeepSeek's
    block-FP8 release (each rank's store: its experts' stored bytes, scales included)
    against one process with offload: every step's loss (fp32, 1e-5) and every adapter
    tensor (1e-5 with its one largest element set aside, as test_ep_quantized's FP8 run
    without offload explains)."""
    from safetensors.torch import load_file

    from test_ep_quantized import _rel_but_one, _two_ranks_and_one

    _two_ranks_and_one(bases["fp8"], bases["data"], tmp_path, offload="cpu")
    got, want = (load_file(str(tmp_path / r / "adapter" / "adapter_model.safetensors"))
                 for r in ("two", "one"))  # fmt: skip
    rel = {k: _rel_but_one(got[k], v) for k, v in want.items()}
    assert max(rel.values()) < 1e-5, rel
    ran = json.loads((tmp_path / "two" / "offload.json").read_text())
    one = json.loads((tmp_path / "one" / "offload.json").read_text())
    assert [r["stored_bytes"] * 2 for r in ran["ranks"]] == [one["stored_bytes"]] * 2
