"""train/distributed/sharded_load.py in one process: the meta build of a non-main rank, its LoRA
given
distinct storage, rank 0's draining state dict, the byte tracker that measures the load –
and benchmarks/sharded_load.py's RSS sampler on a real child process; int8 / NF4 experts
loaded once over 2 gloo ranks (accelerate's FSDP2 prepare). The 2-process training run itself
is in test_train_distributed.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moetune.train.distributed import sharded_load as S
from test_train_helpers import save_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("shard") / "model")


def test_a_meta_rank_builds_the_base_without_its_weights(model_dir):
    from transformers import AutoModelForCausalLM

    meta = S.meta_base(str(model_dir), torch.float32)
    real = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    assert all(p.is_meta for p in meta.parameters())
    assert S.host_bytes(meta) == sum(b.nbytes for b in meta.buffers())  # buffers only
    assert S.host_bytes(real) >= sum(p.nbytes for p in real.parameters())
    assert meta.state_dict().keys() == real.state_dict().keys()
    for (name, got), (_, want) in zip(meta.named_buffers(), real.named_buffers(), strict=True):
        assert torch.equal(got, want), name  # rotary tables computed, not broadcast
    assert not meta.training and type(meta) is type(real)


def test_meta_lora_factors_get_distinct_zeroed_storage(model_dir):
    from peft import LoraConfig, get_peft_model

    meta = S.meta_base(str(model_dir), torch.float32)
    wrapped = get_peft_model(meta, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    S.materialise_trainable(wrapped)
    trainable = [p for p in wrapped.parameters() if p.requires_grad]
    assert trainable and all(not p.is_meta and not p.any() for p in trainable)
    assert len({p.data_ptr() for p in trainable}) == len(trainable)  # accelerate's map key
    assert all(p.is_meta for p in wrapped.parameters() if not p.requires_grad)


def test_rank_0s_state_dict_frees_each_tensor_once_sent():
    """Freed at the next read, aliases included (the model's old parameters); a storage two
    keys share (tied weights) only once both are read."""
    tied = torch.ones(4)
    full = {"a": torch.ones(4), "emb": tied, "head": tied, "b": torch.zeros(2)}
    old_param = full["a"].view(2, 2)  # what the model's replaced parameter still aliases
    drained = S._Draining(full)
    assert "a" in drained and len(drained) == 4
    assert torch.equal(drained["a"], torch.ones(4)) and "a" not in full
    emb = drained["emb"]  # reading on frees what was sent before
    assert old_param.untyped_storage().nbytes() == 0
    assert torch.equal(drained["head"], torch.ones(4))  # its tie was not freed with "emb"
    assert torch.equal(drained["b"], torch.zeros(2)) and emb.untyped_storage().nbytes() == 0
    drained.close()
    assert list(drained) == [] and full == {}


def test_the_load_tracker_counts_local_shards_and_frees(monkeypatch):
    tracker = S.LocalBytes()
    with tracker:
        kept = []
        for _ in range(4):
            full = torch.empty(1000)  # 4000 B in flight, as the broadcast buffer
            kept.append(full[:250].clone())  # 1000 B kept, as the shard
        del full
    assert tracker.live_bytes == 4000  # the shards
    assert tracker.peak.bytes == 4000 - 1000 + 4000 + 4000  # 3 shards + 2 buffers in flight
    with S.LocalBytes() as meta:
        torch.empty(1000, device="meta")
    assert meta.peak.bytes == 0


def test_from_main_outside_a_sharded_load_just_computes(monkeypatch):
    monkeypatch.delenv("FSDP_CPU_RAM_EFFICIENT_LOADING", raising=False)
    assert not S.active() and S.loads_weights()
    assert S.from_main(lambda: {"x": 1}) == {"x": 1}
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert S.active() and not S.loads_weights()
    monkeypatch.setenv("RANK", "0")
    assert S.loads_weights()


_HOLD = "import torch, time; x = torch.ones(64 * 2**20); time.sleep(3)"  # 256 MiB


def test_the_benchmarks_sampler_sees_a_childs_peak_rss():
    import sharded_load as bench

    proc = subprocess.Popen([sys.executable, "-c", _HOLD])
    sampler = bench.Sampler(proc.pid)
    sampler.start()
    proc.wait(timeout=120)
    time.sleep(0.1)
    sampler.done.set()
    sampler.join()
    assert sampler.peaks[0] >= 256 * 2**20
    assert sampler.needed[0] == sampler.peaks[0]  # no checkpoint mapped


def test_an_fsdp_save_gathers_the_lora_and_names_it_as_peft_saves_it(model_dir, tmp_path):
    """The save keeps the files peft writes (same keys, same values) while the frozen base is
    never gathered: the trainable parameters alone, by state-dict name."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    state = S.gathered_trainable(model)
    assert state and all("lora_" in k for k in state)
    assert set(state) == {n for n, p in model.named_parameters() if p.requires_grad}
    saved = []

    class FakeFSDPTrainer:  # the two attributes the save uses, as transformers' Trainer has
        is_fsdp_enabled, args = True, type("Args", (), {"output_dir": str(tmp_path)})

        def __init__(self) -> None:
            self.model = model

        def _save(self, output_dir: str, state_dict: dict) -> None:
            saved.append(output_dir)
            self.model.save_pretrained(output_dir, state_dict=state_dict)

    trainer = S.adapter_only_saves(FakeFSDPTrainer())
    trainer.save_model(str(tmp_path / "a"))
    model.save_pretrained(str(tmp_path / "b"))  # peft's own save of the whole model
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    want = load_file(str(tmp_path / "b" / "adapter_model.safetensors"))
    assert saved == [str(tmp_path / "a")] and got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(model_dir)), str(tmp_path / "a")
    )
    plain = type("Plain", (), {"is_fsdp_enabled": False, "save_model": "unchanged"})()
    assert S.adapter_only_saves(plain).save_model == "unchanged"


# One rank of accelerate's FSDP2 prepare with cpu_ram_efficient_loading (what `moetune train
# --nproc 2 --strategy fsdp` runs), per experts dtype: moetune's load (rank 0 reads and
# quantises, rank 1 builds on meta), prepare(), then each tensor against the rank's own
# whole quantised build.
_RANK = """
import json, sys, types
import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.tensor import DTensor
from moetune.config import parse_config
from moetune.engine.quant.stacks import shardable_
from moetune.engine.quant.load import load_quantized
from moetune.train.distributed import sharded_load as S
from moetune.train.launch import fsdp_on_cpu
from moetune.train.model import load_quantized_model

model_dir, out = sys.argv[1], sys.argv[2]
fsdp_on_cpu()
S.install()
acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(
    fsdp_version=2, cpu_ram_efficient_loading=True, auto_wrap_policy="transformer_based_wrap",
    transformer_cls_names_to_wrap=["Qwen3MoeDecoderLayer"]))
found, ids = {}, torch.tensor([[3, 5, 7, 9, 11, 13]])
for dtype, dq in (("int8", False), ("nf4", True)):
    cfg = parse_config({"model": {"id": model_dir, "dtype": "float32", "experts_dtype": dtype,
                                  "experts_double_quant": dq}})
    place = types.SimpleNamespace(device="cpu")
    model = load_quantized_model(cfg, place, torch.float32, "moetune")
    loaded = S.host_bytes(model)
    model = acc.prepare(model)
    want = shardable_(load_quantized(model_dir, dtype, "cpu", torch.float32, double_quant=dq)[0])
    got, rows = model.state_dict(), {}
    for name, whole in want.state_dict().items():
        mine = got[name]
        local = mine.to_local() if isinstance(mine, DTensor) else mine
        mine = mine.full_tensor() if isinstance(mine, DTensor) else mine
        rows[name] = [torch.equal(mine, whole) and mine.dtype == whole.dtype,
                      local.shape[0], whole.shape[0]]
    with torch.no_grad():
        same = torch.allclose(model(ids).logits, want(ids).logits, rtol=1e-5, atol=1e-6)
    found[dtype] = {"rows": rows, "logits": same, "loaded": loaded}
json.dump(found, open(f"{out}/rank{acc.process_index}.json", "w"))
"""


def test_int8_and_nf4_experts_load_once_and_shard_as_a_whole_build(model_dir, tmp_path):
    """Rank 0 reads and quantises, rank 1 holds nothing of the base before prepare(); after
    it each rank holds half of every quantised stack's tensors (experts split by dim 0: FSDP2
    shards Parameters only), and gathered they equal a whole quantised build, byte for byte."""
    from moetune.train.launch import free_port

    env = {**os.environ, "PYTHONPATH": str(Path(S.__file__).parents[2]), "OMP_NUM_THREADS": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "ACCELERATE_USE_FSDP": "true",
           "FSDP_CPU_RAM_EFFICIENT_LOADING": "true", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    logs = [tmp_path / f"rank{r}.err" for r in (0, 1)]  # files: a full pipe would block
    cmd = [sys.executable, "-c", _RANK, str(model_dir), str(tmp_path)]
    procs = [
        subprocess.Popen(
            cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stderr=logs[r].open("wb")
        )
        for r in (0, 1)
    ]
    for proc, log in zip(procs, logs, strict=True):
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for dtype, parts in (("int8", {"codes", "scales"}), ("nf4", {"codes", "absmax_codes"})):
        main, other = ranks[0][dtype], ranks[1][dtype]
        assert main["loaded"] > 20_000 and other["loaded"] < 100  # rank 1: the rotary table
        for rank in (main, other):
            assert rank["logits"] and all(equal for equal, _, _ in rank["rows"].values())
            stacks = {k: v for k, v in rank["rows"].items() if ".quantized." in k}
            assert parts <= {k.rsplit(".", 1)[1] for k in stacks}
            assert all(local * 2 == whole for _, local, whole in stacks.values())  # 4 experts
