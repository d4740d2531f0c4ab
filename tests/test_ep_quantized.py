"""`train.strategy ep` in every experts dtype (engine/ep_load.py): a base DeepSeek publishes in
block FP8 (the fixture of test_stored_fp8_deepseek.py, sharded with an index as DeepSeek ships
it) and a float base quantised NF4 on each rank. Each rank reads exactly 1/N of the experts'
stored bytes – weights and scales – its stacks equal the slice of a one-process load, and 2 / 4
forked gloo ranks' logits and summed LoRA gradients equal one process's (fp32, 1e-5); the
plan counts a rank's experts at their stored bytes / N. Slow: `moetune train --nproc 2
--strategy ep` over the FP8 base, and with NF4 experts, against one process."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from moetune.engine import ep_load
from moetune.engine.expert_parallel import PART, READ
from moetune.engine.quant.stacks import stacks_of
from moetune.engine.stored import load as stored_load
from test_ep_partitioned_load import _qwen3
from test_stored_fp8_deepseek import deepseek  # noqa: F401  (the module-scoped fixture)

pytestmark = pytest.mark.filterwarnings("ignore")
EXPERTS = 4  # both bases' routed experts


def _sharded(src: Path, out: Path) -> Path:
    """`src` (one model.safetensors) in two shards and an index, as publishers ship a base:
    the layers' tensors split between the files."""
    tensors = load_file(str(src / "model.safetensors"))
    names = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    files: dict[str, dict[str, torch.Tensor]] = {name: {} for name in names}
    for i, key in enumerate(sorted(tensors)):
        files[names[i % 2]][key] = tensors[key]
    out.mkdir()
    for name, part in files.items():
        save_file(part, str(out / name), metadata={"format": "pt"})
    weight_map = {k: n for n, part in files.items() for k in part}
    total = sum(t.nbytes for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    for extra in src.glob("*.json"):
        if extra.name != "model.safetensors.index.json":
            (out / extra.name).write_bytes(extra.read_bytes())
    return out


@pytest.fixture(scope="module")
def bases(deepseek, tmp_path_factory):  # noqa: F811  (the fixture imported above)
    from test_train_helpers import save_tiny_model
    from test_train_stored_int import write_published

    root = tmp_path_factory.mktemp("ep-quantized")
    src = save_tiny_model(root / "bf16", hidden_size=64, moe_intermediate_size=32,
                          intermediate_size=64, head_dim=16, dtype="bfloat16")  # fmt: skip
    write_published(src, root / "int4", root / "copy", "int4-zp-gidx")
    return {"fp8": _sharded(deepseek["fp8"], root / "fp8"), "float": _qwen3(root / "float"),
            "int4": root / "int4", "data": deepseek["data"]}  # fmt: skip


def _expert_bytes(model_dir: Path) -> int:
    """Every routed expert tensor's bytes in the files (weights and their scales)."""
    index = stored_load.index_dir(model_dir)
    return sum(s.nbytes for k, s in index.items() if ".mlp.experts." in k)


def _stacks(model: Any) -> dict[str, Any]:
    """Every quantised stack by name: installed, or a rank's part waiting for shard_experts."""
    out = {}
    for path, module in model.named_modules():
        waiting = module.__dict__.get(PART, {})
        for name, stack in {**stacks_of(module), **waiting}.items():
            out[f"{path}.{name}"] = stack
    return out


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_rank_reads_only_its_experts_stored_bytes(bases, monkeypatch, ranks):
    """FP8 weights and their weight_scale_inv, per-expert keys across two shards: a rank asks
    the files for exactly 1/N of them, and holds the slice of a one-process load, bit for bit."""
    asked: list[Any] = []
    real = stored_load.read_once
    monkeypatch.setattr(stored_load, "read_once", lambda p: asked.extend(x.span for x in p)
                        or real(p))  # fmt: skip
    whole = _stacks(stored_load.load_stored(bases["fp8"], "cpu", torch.float32)[0])
    total, local = _expert_bytes(bases["fp8"]), EXPERTS // ranks
    assert total == sum(s.nbytes for s in whole.values())  # every byte of the experts is a stack's
    for rank in range(ranks):
        asked.clear()
        model, report = ep_load.load_partitioned_stored(bases["fp8"], "cpu", torch.float32,
                                                        rank, ranks)  # fmt: skip
        assert sum(s.nbytes for s in asked) * ranks == total  # scales included, no more
        assert model.__dict__[READ] == {"expert_bytes_read": total // ranks,
                                        "expert_stack_bytes": total}  # fmt: skip
        assert report.stored_bytes * ranks == total
        for name, stack in _stacks(model).items():
            path, stack_name = name.rsplit(".", 1)
            stand_in = model.get_submodule(path)._parameters[stack_name]  # what peft sizes
            assert stand_in.shape == whole[name].shape and stand_in.untyped_storage().nbytes() <= 4
            assert stack.shape == (local, *whole[name].shape[1:])
            for buf, value in stack.stored().items():
                want = whole[name].stored()[buf][rank * local : (rank + 1) * local]
                assert value.dtype == want.dtype and torch.equal(value, want), (name, buf)


def test_int4_with_zero_points_and_g_idx_reads_its_experts(bases, monkeypatch):
    """compressed-tensors INT4 (its own compressor: packed weights, scales, zero points and
    an act-order g_idx per expert): 2 ranks each ask for half the stacks' stored bytes and
    hold the slice of a one-process load in every buffer."""
    asked: list[Any] = []
    real = stored_load.read_once
    monkeypatch.setattr(stored_load, "read_once", lambda p: asked.extend(x.span for x in p)
                        or real(p))  # fmt: skip
    whole = _stacks(stored_load.load_stored(bases["int4"], "cpu", torch.float32)[0])
    assert {"g_idx", "zero"} <= {b for s in whole.values() for b in s.stored()}
    total = sum(s.nbytes for s in whole.values())
    for rank in range(2):
        asked.clear()
        model, _ = ep_load.load_partitioned_stored(bases["int4"], "cpu", torch.float32,
                                                   rank, 2)  # fmt: skip
        assert 2 * sum(s.nbytes for s in asked) == total
        for name, stack in _stacks(model).items():
            for buf, value in stack.stored().items():
                assert torch.equal(value, whole[name].stored()[buf][rank * 2 : rank * 2 + 2])
    # model.quantized_base: dequantize – this rank's experts inflated, as one process's are
    model, _ = ep_load.load_partitioned_stored(bases["int4"], "cpu", torch.float32, 1, 2,
                                               dequantize=True)  # fmt: skip
    for name, stack in whole.items():
        path, stack_name = name.rsplit(".", 1)
        part = model.get_submodule(path).__dict__[PART][stack_name]
        assert torch.equal(part, stack.dequantize(torch.float32)[2:4])


def test_nf4_quantises_only_its_experts_to_the_one_process_bytes(bases):
    """NF4 per rank: this rank's float experts read (1/N of the stacks' bytes) and quantised
    to the very bytes one process's quantisation gives them."""
    from moetune.engine.quant.load import load_quantized

    whole = _stacks(load_quantized(bases["float"], "nf4", "cpu", torch.float32)[0])
    for rank in range(2):
        model, report = ep_load.load_partitioned_quantized(bases["float"], "cpu", torch.float32,
                                                           rank, 2, "nf4")  # fmt: skip
        read = model.__dict__[READ]
        assert 2 * read["expert_bytes_read"] == read["expert_stack_bytes"]
        assert report.bytes_after * 2 == sum(s.nbytes for s in whole.values())
        for name, stack in _stacks(model).items():
            for buf, value in stack.stored().items():
                assert torch.equal(value, whole[name].stored()[buf][rank * 2 : rank * 2 + 2])


# ---------------------------------------------------------------- forked gloo ranks


def _wrapped(model: Any, modules: list[str]) -> Any:
    """Seeded LoRA (B not zero) on `modules` and the fused experts, on split LoRA."""
    from peft import LoraConfig, get_peft_model

    from moetune.engine import apply_split_lora
    from moetune.engine.offload.store import peft_targets

    lora = LoraConfig(
        r=4, target_modules=modules, init_lora_weights=False,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )  # fmt: skip
    torch.manual_seed(1)
    with peft_targets(model):
        wrapped = get_peft_model(model, lora)
    apply_split_lora(wrapped)
    return wrapped


def _load(kind: str, base: Path, rank: int | None, world: int) -> Any:
    """One process's base (`rank` None) or this rank's partitioned one."""
    from moetune.engine.quant.load import load_quantized

    if kind in ("fp8", "int4"):  # published quantised: read as stored
        if rank is None:
            return stored_load.load_stored(base, "cpu", torch.float32)[0]
        return ep_load.load_partitioned_stored(base, "cpu", torch.float32, rank, world)[0]
    if rank is None:
        return load_quantized(base, "nf4", "cpu", torch.float32)[0]
    return ep_load.load_partitioned_quantized(base, "cpu", torch.float32, rank, world, "nf4")[0]


def _grads(model: Any, ids: torch.Tensor, weights: torch.Tensor) -> dict[str, Any]:
    model.train()
    logits = model(input_ids=ids).logits
    (logits * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"logits": logits.detach(), "grads": grads}


def _rank_diffs(model: Any, ids: torch.Tensor, weights: torch.Tensor, want: dict[str, Any],
                part: slice, world: int) -> list[float]:  # fmt: skip
    """This rank's logits on its `part` of the batch and every LoRA gradient against one
    process's (`want`, the whole batch): a replicated gradient summed over the ranks, an
    expert-LoRA slice gathered whole with its 1/N scale undone (ep_lora.py)."""
    from moetune.engine.ep_lora import piece_of, whole

    got = _grads(model, ids[part], weights[part])
    diffs = [_rel(got["logits"], want["logits"][part])]
    params = dict(model.named_parameters())
    for name, grad in got["grads"].items():
        piece = piece_of(params[name])
        if piece is None:
            dist.all_reduce(grad)  # each rank's share of the gradient, summed
        else:
            grad = whole(grad, piece) * world
        diffs.append(_rel(grad, want["grads"][name]))
    return diffs


def _rank(rank: int, world: int, bases: dict[str, str], out: str) -> None:
    """Per kind: one process on the whole batch, then this rank's experts on its half."""
    from moetune.engine.expert_parallel import ep_mesh, ep_report, shard_experts

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))  # fmt: skip
    found: dict[str, Any] = {}
    modules = {"fp8": ["o_proj"], "nf4": ["q_proj", "v_proj"], "int4": ["q_proj", "v_proj"]}
    for kind, base in bases.items():
        torch.manual_seed(3)
        ids = torch.randint(0, 40, (2 * world, 12))
        one = _wrapped(_load(kind, Path(base), None, world), modules[kind])
        weights = torch.randn(2 * world, 12, one.config.vocab_size)
        want = _grads(one, ids, weights)
        model = _wrapped(_load(kind, Path(base), rank, world), modules[kind])
        shard_experts(model, ep_mesh("cpu"))
        diffs = _rank_diffs(model, ids, weights, want, slice(rank * 2, rank * 2 + 2), world)
        held = sorted({s.shape[0] for s in _stacks(model).values()})
        found[kind] = {"diff": max(diffs), "grads": len(diffs) - 1, "report": ep_report(model),
                       "stack_experts": held}  # fmt: skip
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-300))


@pytest.mark.parametrize("world", [2, 4])
def test_ep_ranks_over_fp8_and_nf4_equal_one_process(bases, tmp_path, world):
    """Stored FP8 (DeepSeek's block scales) and NF4 experts – and on 2 ranks compressed-
    tensors INT4 with zero points and g_idx – each rank holding its own: logits and every
    LoRA gradient summed over the ranks equal one process (fp32, 1e-5)."""
    paths = {"fp8": str(bases["fp8"]), "nf4": str(bases["float"])}
    if world == 2:
        paths["int4"] = str(bases["int4"])
    mp.start_processes(_rank, args=(world, paths, str(tmp_path)), nprocs=world,
                       start_method="fork")  # fmt: skip
    for rank in range(world):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for kind in paths:
            assert found[kind]["diff"] < 1e-5, (kind, found[kind])
            assert found[kind]["grads"] >= 8  # attention and every expert stack's A and B
            assert found[kind]["stack_experts"] == [EXPERTS // world]  # its experts only
            report = found[kind]["report"]
            assert report["first_expert"] == rank * EXPERTS // world
            assert report["rows_sent"] > 0 and report["rows_received"] > 0
            assert report["expert_bytes_read"] * world == report["expert_stack_bytes"]


# ---------------------------------------------------------------- the plan


def test_plan_counts_each_ranks_experts_at_their_quantised_bytes():
    """`plan --gpus 2 --strategy ep` with NF4 experts: a rank holds half the stacks at the
    bytes NF4 stores (quant/stacks.py's own quantiser, built on meta), in device memory and in
    host RAM at load alike; a stored FP8 base's experts are planned as stored, 1/N a rank."""
    from moetune.config import parse_config
    from moetune.engine.quant.stacks import stack_nbytes
    from moetune.model import load_spec, spec_from_config
    from moetune.model.census import shrunk_config
    from moetune.plan.devices.host_ram import RUNTIME_HOST_BYTES
    from moetune.plan.devices.sharding import device_report, plan_expert_parallel
    from moetune.plan.fit import analytic

    spec = spec_from_config(shrunk_config("qwen3_moe"), "qwen3_moe")  # 4 layers, 4 experts
    cfg = parse_config({"model": {"experts_dtype": "nf4"}, "train": {"seq_len": 64},
                        "lora": {"rank": 4, "targets": ["attention", "experts"]}})  # fmt: skip
    h, i = spec.hidden_size, spec.expert_intermediate_size
    nf4 = 4 * (stack_nbytes((4, 2 * i, h), "nf4") + stack_nbytes((4, h, i), "nf4"))
    assert nf4 == 55_296  # 98,304 expert parameters at 4.5 bits
    single = analytic(spec, cfg).components
    report = device_report(spec, cfg, ["H100-80GB"], 2, "ep")
    held = report.plans["H100-80GB"].components["frozen_weights"]
    assert held == single["frozen_weights"] - nf4 // 2  # the other rank's half is not here
    whole = single["frozen_weights"] + single["trainable_weights"]
    assert report.host is not None
    assert report.host.main_rank_bytes == RUNTIME_HOST_BYTES + whole - nf4 // 2
    assert report.host.per_node_bytes == 2 * report.host.main_rank_bytes

    fp8 = load_spec("RedHatAI/Qwen3-30B-A3B-FP8-dynamic")  # 128 experts, per-channel FP8
    run = parse_config({"model": {"id": "RedHatAI/Qwen3-30B-A3B-FP8-dynamic"},
                        "lora": {"rank": 16}})  # fmt: skip
    ep = plan_expert_parallel(fp8, run, 8)
    assert ep is not None and ep.experts_per_device == 16
    stored = ep.components["expert_weights"] * 8
    routed = fp8.components.routed_experts
    assert routed < stored < 1.01 * routed  # one byte a weight and a scale per row, 1/8 a rank


# ---------------------------------------------------------------- the CLI (slow)


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def _rel_but_one(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative norm of got − want with its largest element set aside (Adam's eps regime)."""
    diff = (got - want).flatten().double()
    diff[diff.abs().argmax()] = 0
    return float(diff.norm() / want.double().norm())


def _two_ranks_and_one(base: Path, data: Path, tmp_path: Path, **over: Any) -> None:
    """`moetune train --nproc 2 --strategy ep` (batch 2 a rank) into tmp_path/two and one
    process (batch 4) into tmp_path/one, 3 steps each: every step's loss equal (1e-5)."""
    from moetune.config import dump_config
    from test_train_distributed import _train
    from test_train_helpers import run_config

    def write(name: str, **more: Any) -> Path:
        cfg = run_config(base, data, tmp_path / name, max_steps=3, save_steps=3,
                         lora__targets=["attention", "experts"], **over, **more)  # fmt: skip
        (tmp_path / f"{name}.yaml").write_text(dump_config(cfg))
        return tmp_path / f"{name}.yaml"

    _train(write("two", batch_size=2, nproc=2, strategy="ep"), log=tmp_path / "two.log")
    _train(write("one", batch_size=4), log=tmp_path / "one.log")
    got, want = _losses(tmp_path / "two"), _losses(tmp_path / "one")
    assert len(got) == len(want) == 3
    assert max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)) < 1e-5


@pytest.mark.slow
def test_cli_ep_over_a_stored_fp8_base_trains_as_one_process(bases, tmp_path):
    """`moetune train --nproc 2 --strategy ep` over DeepSeek's block-FP8 release (kept as
    stored, sharded): every step's loss equals one process (batch 4 against 2 × 2, fp32,
    1e-5), and so does every adapter tensor – all its elements but at most one (see below);
    each rank read half the experts' stored bytes."""
    _two_ranks_and_one(bases["fp8"], bases["data"], tmp_path)
    got_a, want_a = (load_file(str(tmp_path / r / "adapter" / "adapter_model.safetensors"))
                     for r in ("two", "one"))  # fmt: skip
    rel = {k: _rel_but_one(got_a[k], v) for k, v in want_a.items()}
    assert max(rel.values()) < 1e-5, rel
    # measured: 4.5e-7 at most over the experts' factors (5.8e-5 before every rank padded its
    # micro-batch to one width, train/distributed/ep_padding.py), 1.5e-6 over all tensors
    # with one element set aside. That element is layers.1.self_attn.o_proj.lora_A[3, 222]:
    # 6.0e-5 apart (every other element ≤ 1.2e-7), 5.1e-5 relative over its tensor. It is a
    # replicated factor, whose gradient DDP's all-reduce sums in another order than one
    # process; an element of it is below Adam's eps (1e-8), where the update g / (|g| + eps)
    # follows g itself, so fp32 rounding moves it by percents (at step 1 on the experts, before
    # the padding: g = 4.23e-9 against 4.33e-9). 1e-5 over a whole tensor is not fp32's.
    whole = {k: float((got_a[k] - v).norm() / v.norm()) for k, v in want_a.items()}
    assert max(whole.values()) < 1e-4
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    ran = summary["distributed"]["expert_parallel"]
    total = _expert_bytes(bases["fp8"])
    assert [r["expert_bytes_read"] * 2 for r in ran] == [total, total]  # scales included


@pytest.mark.slow
def test_cli_ep_with_nf4_experts_trains_as_one_process(bases, tmp_path):
    """`moetune train --nproc 2 --strategy ep` with model.experts_dtype nf4 (each rank
    quantises its own experts): 3 steps' loss and the adapter equal one process (batch 4
    against 2 × 2, fp32, 1e-5); each rank read half the float stacks."""
    from test_train_distributed import _rel_diff
    from test_train_helpers import save_tiny_model

    base = save_tiny_model(tmp_path / "base")
    _two_ranks_and_one(base, bases["data"], tmp_path, model__experts_dtype="nf4")
    assert _rel_diff(tmp_path / "two", tmp_path / "one") < 1e-5
    ran = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert all(2 * r["expert_bytes_read"] == r["expert_stack_bytes"]
               for r in ran["distributed"]["expert_parallel"])  # fmt: skip
