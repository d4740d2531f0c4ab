"""Exports over a base published quantised (block FP8, MXFP4, compressed-tensors FP8): the
merge adds ΔW to the dequantised stored weights and writes floats with no quantization_config;
--requantize writes the base's stored layout back and reports how much of ΔW survives the
rounding (refused below the floor, nothing written); the vLLM export leaves the stored base as
published."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from export_fixtures import make_adapter, make_base
from moetune.cli import app
from moetune.engine.stored.load import checkpoint_format, dequantize_stacks_, load_stored
from moetune.engine.stored.write import write_stored
from moetune.export import ExportOptions, resolve_source, run_export
from moetune.export.deltas import delta, iter_deltas
from moetune.export.stored_base import SurvivalTooLow

pytestmark = pytest.mark.filterwarnings("ignore")
TINY = {"hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 2,
        "num_experts": 4, "mlp_only_layers": [], "head_dim": 16, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 64}  # fmt: skip
STORED = {
    "fp8": {"block": (16, 32)},
    "mxfp4": {},
    "fp8-ct": {"per": "channel"},
    "fp8-ct-block": {"block": (16, 32)},
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The float tiny qwen3_moe, its adapter (random B, trained-like scale) and the stored bases."""
    root = tmp_path_factory.mktemp("stored")
    float_base = make_base(root, "qwen3_moe-dense0", **TINY)
    found = {"float": float_base, "adapter": make_adapter(float_base, root / "adapter", 0.05)}
    for method, options in STORED.items():
        found[method] = write_stored(float_base, root / method, method, **options)
    return found


def _expected(base: Path, adapter: Path) -> dict[str, torch.Tensor]:
    """The stored base dequantised (fp32) with every ΔW added, by parameter name."""
    model, _ = load_stored(base, "cpu", torch.float32)
    dequantize_stacks_(model, torch.float32)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    for target, a, b in iter_deltas(adapter, str(base), torch.float32):
        params[target.param] += delta(target, a, b)
    return params


def _loaded(out: Path) -> dict[str, torch.Tensor]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    return {k: v.detach() for k, v in model.named_parameters()}


def _export(bases: dict[str, Path], method: str, out: Path, **opts: object):  # type: ignore[no-untyped-def]
    source = resolve_source(bases["adapter"], str(bases[method]))
    return run_export(source, "merged", out, ExportOptions(**opts))  # type: ignore[arg-type]


@pytest.mark.parametrize("method", list(STORED))
def test_merged_equals_dequantised_base_plus_delta(
    bases: dict[str, Path], tmp_path: Path, method: str
) -> None:
    result = _export(bases, method, tmp_path / "out", dtype="float32")
    assert result.details["stored_base"] == method and not result.details["requantized"]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config
    got, want = _loaded(tmp_path / "out"), _expected(bases[method], bases["adapter"])
    experts = [k for k in want if ".experts." in k]
    assert len(experts) == 4  # 2 layers x gate_up / down
    for name, value in want.items():
        rel = float((got[name] - value).norm() / value.norm())
        assert rel < 1e-6, (name, rel)
    base_float = _loaded(bases["float"])
    moved = float((want[experts[0]] - base_float[experts[0]]).norm())
    assert moved > 0  # the stored base is not the float one: the merge used the stored values


def test_merged_is_bf16_by_default(bases: dict[str, Path], tmp_path: Path) -> None:
    result = _export(bases, "fp8", tmp_path / "out")
    assert result.details["dtype"] == "bfloat16"
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert not any(k.endswith("scale_inv") for k in tensors)
    # the family's own on-disk layout (per-expert keys), as the float checkpoint has it
    assert tensors.keys() == load_file(str(bases["float"] / "model.safetensors")).keys()


@pytest.mark.parametrize("method", list(STORED))
def test_requantize_reports_survival_and_keeps_the_layout(
    bases: dict[str, Path], tmp_path: Path, method: str
) -> None:
    result = _export(bases, method, tmp_path / "out", extra={"requantize": True,
                                                             "survival_floor": 0.0})  # fmt: skip
    figures = result.details["survival"]
    assert len(figures["stacks"]) == 4 and figures["worst"] <= figures["survival"] < 1
    fmt, qcfg = checkpoint_format(tmp_path / "out")  # type: ignore[misc]
    assert fmt.name == method
    assert json.loads((bases[method] / "config.json").read_text())["quantization_config"] == qcfg
    layout = result.details["layout"]
    assert layout["compared"] and layout["same_names"] and layout["same_shapes"]
    record = json.loads((tmp_path / "out" / "export.json").read_text())
    assert record["survival"]["survival"] == figures["survival"]


def test_survival_is_what_the_files_serve(bases: dict[str, Path], tmp_path: Path) -> None:
    result = _export(bases, "fp8", tmp_path / "out", extra={"requantize": True,
                                                            "survival_floor": 0.0})  # fmt: skip
    served, base = (_dequantised(tmp_path / "out"), _dequantised(bases["fp8"]))
    want = _expected(bases["fp8"], bases["adapter"])
    lost = total = 0.0
    for name in result.details["survival"]["stacks"]:
        d = want[name] - base[name]
        lost += float(((served[name] - base[name]) - d).pow(2).sum())
        total += float(d.pow(2).sum())
    assert abs((1 - (lost / total) ** 0.5) - result.details["survival"]["survival"]) < 1e-5


def _dequantised(folder: Path) -> dict[str, torch.Tensor]:
    model, _ = load_stored(folder, "cpu", torch.float32)
    dequantize_stacks_(model, torch.float32)
    return {k: v.detach() for k, v in model.named_parameters()}


def test_requantize_below_the_floor_writes_nothing(bases: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(SurvivalTooLow, match="keeps"):
        _export(bases, "fp8", out, extra={"requantize": True, "survival_floor": 1.0})
    assert not out.exists() and list(tmp_path.iterdir()) == []
    args = ["export", str(bases["adapter"]), "--base", str(bases["fp8"]), "--format", "merged",
            "--out", str(out), "--requantize", "--survival-floor", "1", "--no-check"]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    assert "survival" not in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1 or "floor" in res.output
    assert not out.exists()


def test_requantize_needs_a_quantised_base(bases: dict[str, Path], tmp_path: Path) -> None:
    args = ["export", str(bases["adapter"]), "--base", str(bases["float"]), "--format", "merged",
            "--out", str(tmp_path / "out"), "--requantize", "--no-check"]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "quantization_config" in res.output
    assert not (tmp_path / "out").exists()


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_vllm_leaves_the_stored_base_as_published(bases: dict[str, Path], tmp_path: Path) -> None:
    before = _digests(bases["fp8"])
    source = resolve_source(bases["adapter"], str(bases["fp8"]))
    result = run_export(source, "vllm", tmp_path / "out", ExportOptions())
    assert _digests(bases["fp8"]) == before
    written = sum(p.stat().st_size for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert written < sum(p.stat().st_size for p in bases["fp8"].glob("*.safetensors"))
    assert not list((tmp_path / "out").glob("model*.safetensors"))
    assert str(bases["fp8"]) in json.loads((tmp_path / "out" / "vllm.json").read_text())["serve"]
    assert result.details["family"] == "qwen3_moe"


def test_cli_prints_and_emits_survival(bases: dict[str, Path], tmp_path: Path) -> None:
    args = ["export", str(bases["adapter"]), "--base", str(bases["mxfp4"]), "--format", "merged",
            "--requantize", "--survival-floor", "1e-9", "--no-check"]  # fmt: skip
    shown = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "a")])
    assert shown.exit_code == 0, shown.output
    assert "re-quantised (mxfp4)" in shown.output and "survives" in shown.output
    emitted = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "b"), "--json"])
    figures = json.loads(emitted.stdout)["details"]["survival"]
    assert figures["format"] == "mxfp4" and 0 < figures["survival"] < 1
    vllm = CliRunner().invoke(
        app, [*args[:5], "vllm", "--requantize", "--out", str(tmp_path / "c")]
    )
    assert vllm.exit_code == 2 and "--requantize" in vllm.output
