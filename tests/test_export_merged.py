"""`moetune export --format merged`: peft's own tensors merged in the model's on-disk layout.

Three families (qwen3_moe, gpt_oss with its transposed interleaved stacks, olmoe): the
merge equals peft's merge_and_unload in float64, the saved checkpoint has exactly the
base's tensor names and loads in plain transformers with no missing/unexpected keys, its
logits equal the PeftModel's, and the expert stacks really changed.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from peft import PeftModel
from safetensors.torch import load_file
from typer.testing import CliRunner

from export_fixtures import FAMILIES, make_adapter, make_base, make_run
from moetune.cli import app
from moetune.export import ExportError, ExportOptions, resolve_source, run_export
from moetune.export.deltas import delta, iter_deltas

pytestmark = pytest.mark.filterwarnings("ignore")
IDS = torch.tensor([[5, 9, 12, 30, 7, 22, 41, 3, 17, 8]])


def _load(path: Path, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, output_loading_info=True, experts_implementation="eager"
        )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("variant", FAMILIES)
def test_deltas_equal_peft_merge_float64(tmp_path: Path, variant: str) -> None:
    base = make_base(tmp_path, variant)
    adapter = make_adapter(
        base, tmp_path / "adapter", rank_pattern={"gate_up_proj": 3}, use_rslora=True
    )
    model, _ = _load(base, torch.float64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().state_dict()
    mine = {t.param: delta(t, a, b) for t, a, b in iter_deltas(adapter, str(base), torch.float64)}
    assert any(".experts." in k for k in mine) and any("q_proj" in k for k in mine)
    for name, value in merged.items():
        expected = value - before[name]
        got = mine.get(name, torch.zeros_like(expected))
        assert torch.allclose(got, expected, rtol=0, atol=1e-12), name


@pytest.mark.parametrize("variant", FAMILIES)
def test_merged_loads_and_serves_the_adapter(tmp_path: Path, variant: str) -> None:
    base = make_base(tmp_path, variant)
    adapter = make_adapter(base, tmp_path / "adapter")
    out = tmp_path / "merged"
    result = run_export(
        resolve_source(adapter, str(base)), "merged", out, ExportOptions(dtype="float32")
    )
    layout = result.details["layout"]
    assert layout["compared"] and layout["same_names"] and layout["same_shapes"]
    assert result.details["expert_layers"] == 2 * (3 if variant != "qwen3_moe-dense0" else 2)
    model, info = _load(out)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    peft_model = PeftModel.from_pretrained(_load(base)[0], str(adapter))
    with torch.no_grad():
        ref = peft_model(input_ids=IDS).logits
        assert _rel(model(input_ids=IDS).logits, ref) < 1e-5
    merged_sd, base_sd = (
        load_file(str(out / "model.safetensors")),
        load_file(str(base / "model.safetensors")),
    )
    experts = [k for k in merged_sd if ".experts." in k and "bias" not in k]
    assert experts and all(not torch.equal(merged_sd[k], base_sd[k]) for k in experts)
    assert (out / "tokenizer.json").is_file()


def test_bf16_default_keeps_the_base_dtype_shard_by_shard(tmp_path: Path) -> None:
    base = make_base(tmp_path, "olmoe", torch.bfloat16)
    adapter = make_adapter(base, tmp_path / "adapter")
    out = tmp_path / "merged"
    opts = ExportOptions(max_shard_size="10KB")
    result = run_export(resolve_source(adapter, str(base)), "merged", out, opts)
    assert result.details["dtype"] == "bfloat16"
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 2 and (out / "model.safetensors.index.json").is_file()
    assert {t.dtype for s in shards for t in load_file(str(s)).values()} == {torch.bfloat16}
    _, info = _load(out)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))


def test_cli_export_checks_served_equals_trained(tmp_path: Path) -> None:
    run = make_run(tmp_path, "qwen3_moe-dense0")
    out = tmp_path / "merged"
    got = CliRunner().invoke(
        app, ["export", str(run), "--format", "merged", "--out", str(out), "--json"]
    )
    assert got.exit_code == 0, got.output
    doc = json.loads(got.stdout)
    assert (
        doc["check"]["passed"]
        and doc["check"]["items"] == 6
        and doc["check"]["greedy_match"] == 1.0
    )
    assert doc["check"]["logits_rel"] < 1e-4 < doc["check"]["expert_effect"]
    assert json.loads((out / "check.json").read_text())["passed"]
    rows = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["status"], r["metrics"]["passed"]) for r in rows] == [
        ("export", "ok", True)
    ]
    assert json.loads((run / "exports.json").read_text())["merged"]["check"]["passed"]


def test_refuses_a_non_empty_out_and_unknown_format(tmp_path: Path) -> None:
    run = make_run(tmp_path, "olmoe")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("keep me")
    args = ["export", str(run), "--out", str(tmp_path / "taken"), "--no-check"]
    got = CliRunner().invoke(app, [*args, "--format", "merged"])
    assert got.exit_code == 2 and "not empty" in got.output
    assert (tmp_path / "taken" / "mine.txt").read_text() == "keep me"
    got = CliRunner().invoke(
        app, ["export", str(run), "--out", str(tmp_path / "new"), "--format", "onnx"]
    )
    assert (
        got.exit_code == 2
        and "unknown export format" in got.output
        and not (tmp_path / "new").exists()
    )


def test_refuses_adapter_tensors_it_cannot_place(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    base = make_base(tmp_path, "olmoe")
    adapter = make_adapter(base, tmp_path / "adapter")
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    tensors["base_model.model.model.layers.0.mlp.gate.lora_A.weight"] = torch.zeros(2, 16)
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(ExportError, match="map to no LoRA layer"):
        run_export(resolve_source(adapter, str(base)), "merged", tmp_path / "out", ExportOptions())
    assert not (tmp_path / "out").exists()


def test_lora_on_a_tied_lm_head_is_refused(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    base = make_base(tmp_path, "qwen3_moe-tied-local_experts")
    model, _ = _load(base)
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.normal_()
    wrapped.save_pretrained(str(tmp_path / "adapter"))
    source = resolve_source(tmp_path / "adapter", str(base))
    with pytest.raises(ExportError, match=r"lm_head\.weight is tied to model\.embed_tokens"):
        run_export(source, "merged", tmp_path / "out", ExportOptions())
    assert not (tmp_path / "out").exists()
