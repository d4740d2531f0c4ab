"""Training over a base published quantised: the stacks stay in the stored bytes (loading
never holds a float stack), the run equals a run over the dequantised fp32 copy, offload
reads the stored bytes, and what cannot work is refused in one line before a weight is read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from moetune.engine.quant.stacks import QuantError, stacks_of
from moetune.engine.stored.load import dequantize_stacks_, load_stored
from moetune.engine.stored.write import write_stored
from test_engine_experts_lora import _Largest
from test_train_helpers import one_thread, reverse_rows, run_config, save_tiny_model, write_jsonl

pytestmark = pytest.mark.filterwarnings("ignore")
BLOCK = (8, 8)  # the tiny base's dims (hidden 16, expert width 8) in whole blocks


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny float base, its FP8 release, and that release dequantised to fp32."""
    root = tmp_path_factory.mktemp("stored")
    float_dir = save_tiny_model(root / "float")
    fp8 = write_stored(float_dir, root / "fp8", "fp8", block=BLOCK)
    data = write_jsonl(root / "d.jsonl", reverse_rows(16))
    copy = dequantized_copy(fp8, root / "fp8-dequantized")
    return {"float": float_dir, "fp8": fp8, "copy": copy, "data": data}


def dequantized_copy(stored: Path, out: Path) -> Path:
    """A stored base saved back in fp32, dequantised as moetune dequantises it, with its
    tokenizer: the reference a run over the stored base must equal."""
    model, _ = load_stored(stored, "cpu", torch.float32)
    dequantize_stacks_(model)
    model.save_pretrained(out)
    for extra in stored.glob("*token*"):
        shutil.copy2(extra, out / extra.name)
    return out


def _cfg(bases: dict[str, Path], base: str, out: Path, **train: Any) -> Any:
    return run_config(bases[base], bases["data"], out, lora__targets=["attention", "experts"],
                      max_steps=3, save_steps=3, **train)  # fmt: skip


def _adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(next(run.rglob("adapter_model.safetensors"))))


def test_loaded_stacks_are_the_stored_bytes(bases: dict[str, Path]) -> None:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    model, report = load_stored(bases["fp8"], "cpu", torch.float32)
    stack = stacks_of(model.get_submodule("model.layers.1.mlp.experts"))["gate_up_proj"]
    assert stack.get_buffer("weight").dtype == torch.float8_e4m3fn
    raw = load_file(str(next(bases["fp8"].glob("*.safetensors"))))
    key = "model.layers.1.mlp.experts.2.{}_proj.{}"
    ref = torch.cat([Fp8Dequantize(None)._dequantize_one(raw[key.format(p, "weight")],
                                                         raw[key.format(p, "weight_scale_inv")],
                                                         output_dtype=torch.float32)
                     for p in ("gate", "up")])  # fmt: skip
    assert torch.equal(stack.canonical_expert(2, torch.float32), ref)
    assert report.stacks == 4 and report.stored_bytes < report.float_bytes / 3.5  # fp32 -> fp8
    assert report.dequantized  # the attention Linears stored FP8 come in float


def test_loading_never_holds_a_float_stack(bases: dict[str, Path]) -> None:
    one_expert = 16 * 16 * 4  # the largest expert matrix (gate_up [16, 16]) in fp32
    with _Largest() as largest:
        load_stored(bases["fp8"], "cpu", torch.float32)
    assert largest.nbytes < 4 * 4 * 16 * 16 * 4, largest.op  # a whole stack would be 4 experts
    assert largest.nbytes <= max(one_expert, 256 * 16 * 4), largest.op  # embeddings aside


@pytest.mark.parametrize("offload", ["none", "disk", "cpu"])
def test_run_equals_the_dequantised_copy(bases: dict[str, Path], tmp_path: Path,
                                         offload: str) -> None:  # fmt: skip
    from moetune.train import train

    with one_thread():
        ours = train(_cfg(bases, "fp8", tmp_path / "fp8", offload=offload), progress=False)
        ref = train(_cfg(bases, "copy", tmp_path / "copy"), progress=False)
    assert ours.coverage == ref.coverage == 1.0 and not ours.router_changed and ours.steps == 3
    mine, theirs = _adapter(tmp_path / "fp8"), _adapter(tmp_path / "copy")
    assert mine.keys() == theirs.keys() and any("experts" in k for k in mine)
    for key, value in theirs.items():
        assert float((mine[key] - value).norm() / value.norm().clamp_min(1e-12)) < 1e-5, key
    quant = json.loads((tmp_path / "fp8" / "quant.json").read_text())
    assert quant["format"] == "fp8" and quant["stacks"] == 4
    assert quant["linears_stored"] == 8 and quant["dequantized"] == 0  # q/k/v/o: kept as stored
    if offload != "none":
        stats = json.loads((tmp_path / "fp8" / "offload.json").read_text())
        assert stats["stored_bytes"] == quant["stored_bytes"]  # the store holds stored bytes
        if offload == "disk":  # 3 steps, and the base's routing in one forward (not 8)
            assert 3 < stats["bytes_read"]["forward"] / quant["stored_bytes"] < 5


def _broken(bases: dict[str, Path], tmp_path: Path, edit: Any) -> Path:
    out = tmp_path / "broken"
    shutil.copytree(bases["fp8"], out)
    (shard,) = out.glob("*.safetensors")
    tensors = load_file(str(shard))
    edit(tensors, out)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return out


def _nan_scale(t: dict[str, torch.Tensor], _: Path) -> None:
    t["model.layers.0.mlp.experts.1.down_proj.weight_scale_inv"][0, 0] = float("nan")


def _zero_scale(t: dict[str, torch.Tensor], _: Path) -> None:
    t["model.layers.0.mlp.experts.1.down_proj.weight_scale_inv"].zero_()


def _no_scale(t: dict[str, torch.Tensor], _: Path) -> None:
    del t["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"]


def _bad_shape(t: dict[str, torch.Tensor], _: Path) -> None:
    key = "model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv"
    t[key] = torch.ones(3, 2)


def _unknown(t: dict[str, torch.Tensor], out: Path) -> None:
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "higgs", "bits": 4}
    (out / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(("edit", "says"), [
    (_nan_scale, "NaN, Inf or zero"), (_zero_scale, "NaN, Inf or zero"),
    (_no_scale, "no 'weight_scale_inv' tensors"), (_bad_shape, "scale grid [6, 2] is not ceil"),
    (_unknown, "cannot read checkpoints quantised as higgs"),
])  # fmt: skip
def test_bad_checkpoints_refused_in_one_line(bases: dict[str, Path], tmp_path: Path,
                                             edit: Any, says: str) -> None:  # fmt: skip
    from typer.testing import CliRunner

    from moetune.cli import app

    broken = _broken(bases, tmp_path, edit)
    cfg = _cfg(bases, "fp8", tmp_path / "run")
    cfg.model.id = str(broken)
    (tmp_path / "run.yaml").write_text(json.dumps(cfg.model_dump(mode="json")))
    result = CliRunner().invoke(app, ["train", str(tmp_path / "run.yaml")])
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output
    assert not list((tmp_path / "run").rglob("adapter_model.safetensors"))


def test_peft_engine_refused_before_loading(bases: dict[str, Path], tmp_path: Path) -> None:
    from moetune.train import train
    from moetune.train.errors import TrainError

    cfg = _cfg(bases, "fp8", tmp_path / "run")
    cfg.lora.engine = "peft"
    with pytest.raises(TrainError, match="stored as fp8") as err:
        train(cfg, progress=False)
    assert "quantized_base: dequantize" in err.value.fix
    assert not (tmp_path / "run" / "config.yaml").exists()  # refused before anything is written


def test_dequantize_mode_trains_the_float_copy(bases: dict[str, Path], tmp_path: Path) -> None:
    from moetune.train import train

    cfg = _cfg(bases, "fp8", tmp_path / "run")
    cfg.model.quantized_base = "dequantize"
    with one_thread():
        result = train(cfg, progress=False)
    assert result.coverage == 1.0 and not (tmp_path / "run" / "quant.json").exists()


def test_stored_scale_check_names_the_tensor() -> None:
    from moetune.engine.stored.fp8 import BlockFP8

    fp8 = BlockFP8.configured(block=(8, 8))
    bufs = fp8.quantize(torch.randn(1, 16, 16))
    bufs["scale_inv"][0, 1, 1] = 0
    with pytest.raises(QuantError, match=r"experts\.gate_up_proj"):
        fp8.check(bufs, (16, 16), "model.layers.0.mlp.experts.gate_up_proj")


@pytest.mark.parametrize("offload", ["disk", "cpu"])
def test_bad_scales_refused_when_offloaded(bases: dict[str, Path], tmp_path: Path,
                                           offload: str) -> None:  # fmt: skip
    """Offloaded stacks are read per step, but their scales are checked once at load."""
    from moetune.train import train

    cfg = _cfg(bases, "fp8", tmp_path / "run", offload=offload)
    cfg.model.id = str(_broken(bases, tmp_path, _zero_scale))
    with pytest.raises(QuantError, match="NaN, Inf or zero"):
        train(cfg, progress=False)


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A bf16 base whose dims every format's blocks divide, and its FP8 and MXFP4 releases."""
    root = tmp_path_factory.mktemp("wide")
    save_tiny_model(root / "bf16", hidden_size=64, moe_intermediate_size=32, intermediate_size=64,
                    head_dim=16, dtype="bfloat16")  # fmt: skip
    bf16 = root / "bf16"
    fp8 = write_stored(bf16, root / "fp8", "fp8", block=(32, 32))
    return {"bf16": bf16, "fp8": fp8, "mxfp4": write_stored(bf16, root / "mxfp4", "mxfp4")}


def _bytes_read_per_step(model_dir: Path) -> int:
    """Disk offload: bytes the store reads from the files for one forward + backward."""
    from moetune.engine import IMPLEMENTATION, register
    from moetune.engine.offload.load import load_offloaded
    from moetune.engine.offload.store import store_of
    from moetune.engine.stored.load import checkpoint_format

    stored = checkpoint_format(model_dir) is not None
    model, _, _ = load_offloaded(model_dir, "disk", "cpu", torch.float32, stored=stored)
    register()
    model.set_experts_implementation(IMPLEMENTATION)
    ids = torch.arange(12)[None] % model.config.vocab_size
    model.get_input_embeddings().weight.requires_grad_(True)  # a backward through the experts
    model(input_ids=ids, labels=ids).loss.backward()
    store = store_of(model)
    store.wait_prefetch()  # type: ignore[union-attr]  # the read ahead at the end counts too
    return sum(store.stats.bytes_read.values())  # type: ignore[union-attr]


def test_offload_reads_the_stored_bytes(wide: dict[str, Path]) -> None:
    """An FP8 base reads about half of its bf16 release per step, MXFP4 about a quarter."""
    bf16 = _bytes_read_per_step(wide["bf16"])
    fp8, mxfp4 = _bytes_read_per_step(wide["fp8"]), _bytes_read_per_step(wide["mxfp4"])
    assert bf16 > 0
    assert fp8 / bf16 == pytest.approx((1 + 4 / 32**2) / 2, abs=1e-3)  # 1 B + a scale a block
    assert mxfp4 / bf16 == pytest.approx((0.5 + 1 / 32) / 2, abs=1e-3)  # e2m1 + e8m0 per 32


def test_dpo_and_grpo_over_a_stored_base(bases: dict[str, Path], tmp_path: Path) -> None:
    """The methods load the base the same way: both train over the stored stacks."""
    from moetune.train import train

    words = ["abc", "moe", "tune", "lora"] * 2
    pref = write_jsonl(tmp_path / "pref.jsonl", [
        {"prompt": f"rev:{w}>", "chosen": w[::-1], "rejected": w} for w in words])  # fmt: skip
    rows = write_jsonl(tmp_path / "rows.jsonl", [
        {"prompt": f"rev:{w}>", "answer": w[::-1]} for w in words])  # fmt: skip
    grpo = {"num_generations": 4, "max_completion_length": 6}
    runs = [("dpo", pref, {}), ("grpo", rows, {"batch_size": 8, "grpo": grpo})]
    with one_thread():
        for method, data, extra in runs:
            cfg = run_config(bases["fp8"], data, tmp_path / method, method=method, max_steps=2,
                             lora__targets=["attention", "experts"], **extra)  # fmt: skip
            result = train(cfg, progress=False)
            assert (result.method, result.steps, result.coverage) == (method, 2, 1.0)
            quant = json.loads((tmp_path / method / "quant.json").read_text())
            assert quant["format"] == "fp8" and not result.router_changed


@pytest.mark.parametrize(
    "method", ["mxfp4", "nvfp4", "nvfp4-ct", "int4", "int4-zp-gidx", "awq", "gptq"]
)
def test_every_format_trains_as_its_dequantised_copy(wide: dict[str, Path], tmp_path: Path,
                                                     method: str) -> None:  # fmt: skip
    """The other published formats through the same run: the adapter of the run over the
    dequantised fp32 copy, to 1e-5."""
    from moetune.train import train

    stored = write_stored(wide["bf16"], tmp_path / method, method)
    dequantized_copy(stored, tmp_path / "dequantized")
    data = write_jsonl(tmp_path / "d.jsonl", reverse_rows(8))
    runs = {}
    with one_thread():
        for name, base in (("stored", stored), ("copy", tmp_path / "dequantized")):
            cfg = run_config(base, data, tmp_path / name, lora__targets=["attention", "experts"],
                             max_steps=2, save_steps=2)  # fmt: skip
            runs[name] = train(cfg, progress=False)
    assert runs["stored"].coverage == 1.0
    mine, theirs = _adapter(tmp_path / "stored"), _adapter(tmp_path / "copy")
    for key, value in theirs.items():
        assert float((mine[key] - value).norm() / value.norm().clamp_min(1e-12)) < 1e-5, key
