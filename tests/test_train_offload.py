"""train.offload cpu | disk: frozen expert stacks kept in host RAM or in the base's safetensors
files and streamed a layer at a time (engine/offload/store.py).

A run with offload must train exactly the adapter the same run trains without it (fp32,
relative norm), reach every target and leave the router frozen; at its peak no more than two
layers of expert stacks may be materialised, as the store's own counter measures it (a weight
something else kept alive still counts, which the last test shows); quantised experts are
offloaded quantised; what cannot work is refused before the run dir is written.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from moetune.train.errors import TrainError
from test_train_helpers import one_thread, reverse_rows, run_config, write_jsonl

pytestmark = pytest.mark.filterwarnings("ignore")
LAYERS, EXPERTS, HIDDEN, MOE = 4, 4, 16, 8
LAYER_BYTES = EXPERTS * (2 * MOE * HIDDEN + HIDDEN * MOE) * 4  # gate_up + down, fp32


def save_model(out: Path) -> Path:
    """A 4-layer Qwen3-MoE (hidden 16, 4 experts, top-2) with the demo char tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from moetune.demo.tokenizer import build_tokenizer

    tok = build_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=24,
        moe_intermediate_size=MOE, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=EXPERTS, num_experts_per_tok=2,
        max_position_embeddings=64, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("offload")
    return save_model(root / "model"), write_jsonl(root / "d.jsonl", reverse_rows(16))


def _run(tiny: tuple[Path, Path], out: Path, offload: str, resume: bool = False,
         progress: bool = False, **over: Any) -> Any:  # fmt: skip
    from moetune.train import train

    experts_dtype = over.pop("experts_dtype", "bf16")
    train_over = {"max_steps": 3, "save_steps": 3, **over}
    cfg = run_config(*tiny, out, lora__engine="moetune", lora__targets=["attention", "experts"],
                     offload=offload, **train_over)  # fmt: skip
    cfg.model.experts_dtype = experts_dtype
    with one_thread():
        return train(cfg, resume=resume, progress=progress)


def _adapter(result: Any) -> dict[str, torch.Tensor]:
    return load_file(str(Path(result.adapter_dir) / "adapter_model.safetensors"))


def _assert_same_adapter(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == ref.keys() and any("experts" in k for k in ref)
    for key, tensor in ref.items():
        rel = float((ours[key] - tensor).double().norm() / tensor.double().norm().clamp_min(1e-30))
        assert rel < 1e-5, (key, rel)


@pytest.fixture(scope="module")
def plain(tiny: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The same run without offload (checkpointing changes no number, only the memory)."""
    return _run(tiny, tmp_path_factory.mktemp("plain") / "run", "none")


@pytest.mark.parametrize(("offload", "checkpointing"), [("cpu", False), ("disk", True)])
def test_offloaded_run_equals_the_run_without(
    tiny: tuple[Path, Path], plain: Any, tmp_path: Path, offload: str,
    checkpointing: bool,
) -> None:  # fmt: skip
    result = _run(tiny, tmp_path / "run", offload, gradient_checkpointing=checkpointing)
    ref = plain
    assert result.coverage == 1.0 and not result.router_changed and result.steps == 3
    _assert_same_adapter(_adapter(result), _adapter(ref))
    assert result.final_loss == pytest.approx(ref.final_loss, rel=1e-5)
    stats = json.loads((tmp_path / "run" / "offload.json").read_text())
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["offload"] == stats
    assert (stats["mode"], stats["layers"], stats["layer_bytes"]) == (offload, LAYERS, LAYER_BYTES)
    # measured at its maximum: one layer in use and the next one prefetched, never more
    assert LAYER_BYTES <= stats["peak_resident_bytes"] <= 2 * LAYER_BYTES
    moved = stats["bytes_moved"]
    assert moved["forward"] >= 3 * LAYERS * LAYER_BYTES  # every step streams every layer
    assert moved["backward"] + moved["recompute"] >= 3 * (LAYERS - 2) * LAYER_BYTES
    assert (moved["recompute"] > 0) == checkpointing  # the recompute reloads by itself
    read = stats["bytes_read"]
    assert (sum(read.values()) == sum(moved.values())) == (offload == "disk")
    assert not (tmp_path / "run" / ".staging").exists()


def test_offloaded_run_resumes(tiny: tuple[Path, Path], plain: Any, tmp_path: Path) -> None:
    """A checkpoint holds the adapter only (the offloaded weights are the base's), and a
    resumed offloaded run ends where the uninterrupted one does."""
    out = tmp_path / "run"
    _run(tiny, out, "disk", save_steps=2)
    saved = sorted(p.name for p in (out / "checkpoints" / "step-2").iterdir())
    assert not any("experts" in name or name.startswith("model") for name in saved)
    (out / "summary.json").unlink()  # as if it had stopped after step 2
    shutil.rmtree(out / "checkpoints" / "step-3")  # the final save
    result = _run(tiny, out, "disk", resume=True, save_steps=2)
    assert result.resumed_from_step == 2 and result.steps == 3
    _assert_same_adapter(_adapter(result), _adapter(plain))


def test_offloaded_int8_experts_stream_quantised(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:  # fmt: skip
    ref = _run(tiny, tmp_path / "ref", "none", experts_dtype="int8")
    result = _run(tiny, tmp_path / "run", "disk", experts_dtype="int8")
    assert result.coverage == 1.0 and not result.router_changed
    _assert_same_adapter(_adapter(result), _adapter(ref))
    stats = json.loads((tmp_path / "run" / "offload.json").read_text())
    rows = EXPERTS * (2 * MOE + HIDDEN)  # int8 codes + one fp32 scale per row, not fp32
    assert stats["layer_bytes"] == LAYER_BYTES // 4 + rows * 4
    assert stats["peak_resident_bytes"] <= 2 * stats["layer_bytes"]
    assert sum(stats["bytes_read"].values()) > 0  # read back from the scratch file
    quant = json.loads((tmp_path / "run" / "quant.json").read_text())
    assert quant["method"] == "int8" and len(quant["layers"]) == LAYERS


def test_the_run_reports_the_plan_of_its_offload(
    tiny: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:  # fmt: skip
    """summary.json, preflight.json, the closing line, the ledger row and the HTML report all
    carry the disk-offload plan of the run (host RAM is the device on a CPU: the process's
    planned RSS), not the plan of the same model held whole on one device; the progress
    line and metrics.jsonl say what the store read."""
    from moetune.cli.commands import _report_train
    from moetune.cli.common import console
    from moetune.model import load_spec
    from moetune.plan import make_plan
    from moetune.plan.offload.memory import plan_offload
    from moetune.report import build_report
    from moetune.units import human_bytes

    result = _run(tiny, tmp_path / "run", "disk", progress=True)
    bar = " ".join(capsys.readouterr().err.split())
    assert re.search(r"read \d+\.\d KiB at \d+\.\d [KMG]iB/s · (read|compute)-bound \(waited", bar)
    assert "tok/s" in bar and " 0 tok/s" not in bar
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    read = [r["offload_bytes_read"] for r in rows if "loss" in r]
    assert read == sorted(read) and read[0] >= LAYERS * LAYER_BYTES  # a step reads every layer
    cfg = run_config(*tiny, tmp_path / "run", lora__engine="moetune", offload="disk",
                     lora__targets=["attention", "experts"], max_steps=3, save_steps=3)  # fmt: skip
    cfg.model.dtype = "float32"  # a CPU run holds the base in fp32 (setup.Placement)
    spec = load_spec(str(tiny[0]))
    planned = plan_offload(spec, cfg, None).host_ram_bytes
    assert planned != make_plan(spec, cfg, cards=[]).peak_bytes  # not the offload-none plan
    assert result.planned_peak_bytes == planned
    run = tmp_path / "run"
    memory = json.loads((run / "summary.json").read_text())["memory"]
    assert (memory["planned_peak_bytes"], memory["planned_by"]) == (planned, "offload")
    assert memory["measured"] == "process_peak_rss" and "peak RSS" in memory["compared"]
    assert memory["measured_over_planned"] == round(result.peak_memory_bytes / planned, 4)
    preflight = json.loads((run / "preflight.json").read_text())["run_plan"]
    assert preflight["peak_bytes"] == planned and preflight["detail"]["offload"] == "disk"
    row = json.loads((tmp_path / "ledger.jsonl").read_text().splitlines()[-1])
    assert row["metrics"]["planned_peak_bytes"] == planned
    with console.capture() as captured:
        _report_train(result, False)
    line = " ".join(captured.get().split())  # unwrapped
    assert f"{human_bytes(planned)} planned (offload disk, host RAM as device)" in line
    html = build_report(run).read_text()
    assert f"{planned:,}" in html and "planned peak (offload disk, host RAM as device)" in html


@pytest.mark.parametrize(
    ("over", "match"),
    [({"lora__engine": "peft"}, "split-LoRA engine"),
     ({"lora__targets": ["attention"]}, "split-LoRA engine")],
)  # fmt: skip
def test_offload_refused_before_anything_is_written(
    tiny: tuple[Path, Path], tmp_path: Path, over: dict[str, Any], match: str
) -> None:  # fmt: skip
    from moetune.train import train

    base = {"lora__engine": "moetune", "lora__targets": ["attention", "experts"]}
    cfg = run_config(*tiny, tmp_path / "run", offload="disk", **{**base, **over})
    with pytest.raises(TrainError, match=match) as err:
        train(cfg, progress=False)
    assert "train.offload: none" in str(err.value)
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_disk_offload_needs_safetensors_files(tmp_path: Path) -> None:
    from moetune.config import parse_config
    from moetune.train.offload import check_offload

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "pytorch_model.bin").write_bytes(b"")
    cfg = parse_config({"model": {"id": str(tmp_path / "m")}, "train": {"offload": "disk"},
                        "output": {"dir": str(tmp_path / "run")}})  # fmt: skip
    with pytest.raises(TrainError, match="safetensors"):
        check_offload(cfg, "moetune", str(tmp_path / "m"))
    gguf = cfg.model_copy(update={"model": cfg.model.model_copy(update={"format": "gguf"})})
    with pytest.raises(TrainError, match="GGUF"):
        check_offload(gguf, "moetune", None)


def test_the_counter_sees_weights_kept_alive(tiny: tuple[Path, Path]) -> None:
    """The resident count follows the tensors themselves, not the store's bookkeeping."""
    from moetune.engine.offload.load import load_offloaded

    _, store, _ = load_offloaded(tiny[0], "disk", "cpu", torch.float32)
    kept = store.fetch(0, "down_proj")  # held past its layer, as a leak would
    for layer in range(1, LAYERS):
        store.fetch(layer, "down_proj")
    store.wait_prefetch()  # the last layer in use, the one before it read ahead
    assert store.stats.resident_bytes == 2 * LAYER_BYTES + kept.nbytes
    del kept
    assert store.stats.resident_bytes == 2 * LAYER_BYTES
    store.release()
    assert store.stats.resident_bytes == 0


def test_the_store_clocks_its_loads_and_the_waits(tiny: tuple[Path, Path]) -> None:
    """load_s: time materialising layers; wait_s: what the compute thread spent blocked on
    them – with no compute between fetches, every load but the first prefetch is waited on."""
    import time

    from moetune.engine.offload.load import load_offloaded

    _, store, _ = load_offloaded(tiny[0], "disk", "cpu", torch.float32)
    read = store.reader.read
    store.reader.read = lambda pieces: (time.sleep(0.05), read(pieces))[1]  # a slow disk
    for layer in range(LAYERS):
        store.fetch(layer, "down_proj")
    store.wait_prefetch()
    assert store.stats.fetches == LAYERS + 1  # the last layer turns round: one read ahead
    assert store.stats.load_s >= 0.05 * store.stats.fetches
    assert 0.05 * LAYERS <= store.stats.wait_s <= store.stats.load_s + 0.05


def test_disk_benchmark_smoke(tmp_path: Path) -> None:
    """benchmarks/offload_disk.py --smoke: writes the checkpoint shard by shard, takes a step
    with its experts read from the files, measures, and deletes the checkpoint."""
    import os
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "offload_disk.py"
    out, report = tmp_path / "ckpt", tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, str(script), "--smoke", "--threads=1", "--out",
                          str(out), "--json", str(report)], env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads(report.read_text())
    (step,) = r["steps"]
    layers = r["shape"]["num_hidden_layers"]
    assert r["expert_bytes"] == layers * r["expert_layer_bytes"] > 0
    assert r["checkpoint_bytes"] > r["expert_bytes"]
    assert step["bytes_read"] >= r["expert_bytes"]  # every layer read at least once
    device_layer = 2 * r["expert_layer_bytes"]  # fp32 on the device, bf16 in the files
    assert device_layer <= step["peak_resident_expert_bytes"] <= 2 * device_layer
    assert r["rss_peak_steps"] > 0 and not out.exists()  # deleted without --keep
    assert "plan:" in run.stdout
