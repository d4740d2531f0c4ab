"""NVFP4 declared only in `hf_quant_config.json` (NVIDIA's ModelOpt exports, e.g.
Qwen3-235B-A22B-NVFP4: config.json has no quantization_config) is read as NVFP4 – by the spec
every stage reads, the planner and the loader – and loads equal to ModelOpt's own dequantise.

The fixture is ModelOpt's layout with ModelOpt's own quantiser (`NVFP4QTensor.quantize` per
Linear: `weight` uint8 e2m1 pairs, `weight_scale` fp8-e4m3 per 16, a 0-dim fp32
`weight_scale_2`, an `input_scale`), its `exclude_modules` honoured as its export does."""

from __future__ import annotations

import fnmatch
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from moetune.engine.stored.formats import published_quantised
from test_train_helpers import save_tiny_model

EXCLUDE = ["lm_head", "model.layers.0.self_attn*"]  # layer 0's attention stays float
HF_QUANT = {
    "producer": {"name": "modelopt", "version": "0.47.0"},
    "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                     "exclude_modules": EXCLUDE},
}  # fmt: skip


def _nvfp4_qtensor() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    return NVFP4QTensor


def _quantised(key: str) -> bool:
    module = key.removesuffix(".weight")
    excluded = any(fnmatch.fnmatch(module, p) for p in EXCLUDE)
    return key.endswith("proj.weight") and published_quantised(key) and not excluded


def modelopt_nvfp4(src: Path, out: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """`src` exported as ModelOpt writes NVFP4; the reference: each quantised weight as
    ModelOpt's `NVFP4QTensor.dequantize` gives it back (fp32)."""
    qtensor = _nvfp4_qtensor()
    out.mkdir(parents=True)
    tensors, ref = {}, {}
    for key, w in load_file(str(src / "model.safetensors")).items():
        if not _quantised(key):
            tensors[key] = w
            continue
        q, scale, scale_2 = qtensor.quantize(w.float(), 16)
        base = key.removesuffix(".weight")
        tensors |= {key: q._quantized_data, f"{base}.weight_scale": scale,
                    f"{base}.weight_scale_2": scale_2.reshape(()),
                    f"{base}.input_scale": torch.tensor(1.0)}  # fmt: skip
        ref[key] = q.dequantize(torch.float32, scale=scale, double_scale=scale_2,
                                block_sizes={-1: 16})  # fmt: skip
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for extra in src.iterdir():  # config.json as exported: no quantization_config
        if extra.name != "model.safetensors":
            (out / extra.name).write_bytes(extra.read_bytes())
    (out / "hf_quant_config.json").write_text(json.dumps(HF_QUANT))
    return out, ref


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("hfq")
    src = save_tiny_model(root / "float", moe_intermediate_size=16)  # NVFP4 blocks of 16
    return modelopt_nvfp4(src, root / "nvfp4")


def test_spec_reads_hf_quant_config(nvfp4: tuple[Path, dict[str, torch.Tensor]]) -> None:
    from moetune.engine.stored.formats import stored_format
    from moetune.engine.stored.nvfp4 import NVFP4
    from moetune.model import load_spec

    qcfg = load_spec(str(nvfp4[0])).quant_config
    assert "quantization_config" not in json.loads((nvfp4[0] / "config.json").read_text())
    assert qcfg is not None and qcfg["quant_method"] == "modelopt"
    assert qcfg["exclude_modules"] == EXCLUDE and qcfg["group_size"] == 16
    assert stored_format(qcfg) is NVFP4


def test_config_json_own_quantization_config_wins(tmp_path: Path) -> None:
    from moetune.model.hf_config import with_hf_quant_config

    own = {"quantization_config": {"quant_method": "fp8"}}
    assert with_hf_quant_config(own, HF_QUANT) == own
    assert with_hf_quant_config({}, {"producer": {"name": "modelopt"}}) == {}


def test_loads_equal_to_modelopt_dequantize(nvfp4: tuple[Path, dict[str, torch.Tensor]]) -> None:
    from moetune.engine.stored.load import dequantize_stacks_, load_stored

    model, report = load_stored(nvfp4[0], "cpu", torch.float32, keep_linears=True)
    assert report.linears_stored == 4  # layer 1's q, k, v, o; layer 0's attention excluded
    dequantize_stacks_(model)
    state, ref = model.state_dict(), nvfp4[1]
    for layer in range(2):
        experts = f"model.layers.{layer}.mlp.experts"
        for e in range(4):
            parts = [ref[f"{experts}.{e}.{p}_proj.weight"] for p in ("gate", "up")]
            assert torch.equal(state[f"{experts}.gate_up_proj"][e], torch.cat(parts))
            down = ref[f"{experts}.{e}.down_proj.weight"]
            assert torch.equal(state[f"{experts}.down_proj"][e], down)
    for proj in ("q", "k", "v", "o"):
        key = f"self_attn.{proj}_proj.weight"
        assert torch.equal(state[f"model.layers.1.{key}"], ref[f"model.layers.1.{key}"])
        assert f"model.layers.0.{key}" not in ref  # excluded: the float weight, as written


def test_plan_sizes_it_as_nvfp4(nvfp4: tuple[Path, dict[str, torch.Tensor]]) -> None:
    from typer.testing import CliRunner

    from moetune.cli import app

    result = CliRunner().invoke(app, ["plan", str(nvfp4[0]), "--card", "h100-80gb", "--json"])
    assert result.exit_code == 0, result.output
    stored = json.loads(result.stdout)["stored_experts"]
    assert stored["format"].startswith("NVFP4") and stored["as_stored"]
    assert stored["bytes_per_param"] == 0.5 + 1 / 16


def _kept_bytes(model_dir: Path) -> tuple[int, int]:
    """(bytes of the tensors the loaded model keeps, their second-level scales' bytes):
    input_scale is for activations a weight-only LoRA run never quantises."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    kept = {k: t for k, t in tensors.items() if not k.endswith("input_scale")}
    scale_2 = sum(t.nbytes for k, t in kept.items() if k.endswith("weight_scale_2"))
    return sum(t.nbytes for t in kept.values()), scale_2


def test_planned_frozen_bytes_are_the_files(tmp_path: Path) -> None:
    """Its exclude_modules (layer 0's attention in bf16) planned as the files hold them."""
    from moetune.config import parse_config
    from moetune.model import load_spec
    from moetune.plan.analytic import frozen_bytes
    from moetune.plan.step import Step

    src = save_tiny_model(tmp_path / "float", dtype="bfloat16", moe_intermediate_size=16)
    out, _ = modelopt_nvfp4(src, tmp_path / "nvfp4")
    spec = load_spec(str(out))
    cfg = parse_config({"model": {"id": str(out)}, "lora": {"engine": "moetune"}})
    step = Step.from_config(cfg, spec)
    assert step.stored_experts == "nvfp4" and step.stored_linear_params == 1536  # layer 1's
    files, scale_2 = _kept_bytes(out)
    # the plan counts scales per 16 values; the 0-dim second-level scales are its slack
    assert abs(frozen_bytes(spec, step) - files) <= scale_2


@pytest.mark.parametrize(("qcfg", "module", "kept"), [
    ({"ignore": ["lm_head", "re:.*self_attn.*"]}, "model.layers.3.self_attn.q_a_proj", True),
    ({"ignore": ["re:.*self_attn.*"]}, "model.layers.3.mlp.shared_experts.up_proj", False),
    ({"ignore": ["model.layers.0.mlp.down_proj"]}, "model.layers.0.mlp.down_proj", True),
    ({"ignore": ["model.layers.0.mlp.down_proj"]}, "model.layers.10.mlp.down_proj", False),
    ({"exclude_modules": ["model.layers.*.self_attn*"]}, "model.layers.7.self_attn.o_proj", True),
    ({"exclude_modules": ["lm_head"]}, "model.layers.7.self_attn.o_proj", False),
    ({"modules_to_not_convert": ["model.layers.*.self_attn"]}, "model.layers.2.self_attn.k_proj",
     True),
    ({"modules_to_not_convert": ["shared_expert"]}, "model.layers.2.mlp.shared_expert", True),
    ({"modules_to_not_convert": ["model.layers.1"]}, "model.layers.11.self_attn.k_proj", False),
    ({"modules_to_not_convert": ["mlp.gate"]}, "model.layers.1.mlp.gate_proj", False),
])  # fmt: skip
def test_kept_float_reads_each_publishers_list(qcfg: dict[str, Any], module: str,
                                               kept: bool) -> None:  # fmt: skip
    from moetune.engine.stored.formats import kept_float

    assert kept_float(qcfg, module) is kept


def test_trace_builds_the_excluded_linears_float(
    nvfp4: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    from moetune.engine.stored.linear import StoredLinear, store_float_linears_
    from moetune.model import load_spec
    from moetune.model.build import build_model

    spec = load_spec(str(nvfp4[0]))
    model = build_model(spec)  # on meta, as the trace builds it
    assert store_float_linears_(model, "nvfp4", {}, spec.quant_config) == 4
    stored = [p for p, m in model.named_modules() if isinstance(m, StoredLinear)]
    assert len(stored) == 4 and all(p.startswith("model.layers.1.self_attn.") for p in stored)
