"""NVFP4 declared only in `hf_quant_config.json` (NVIDIA's ModelOpt exports, e.g.
Qwen3-235B-A22B-NVFP4: config.json has no quantization_config) is read as NVFP4 – by the spec
every stage reads, the planner and the loader – and loads equal to ModelOpt's own dequantise.

Two fixtures, each with config.json's quantization_config removed as in NVIDIA's large repos:
written by ModelOpt itself on the CPU (`mtq.quantize` with NVFP4_DEFAULT_CFG, layer 0's
attention disabled, then `export_hf_checkpoint`: slow, importing its exporter takes ~15 s), and
the same layout per Linear from ModelOpt's own `NVFP4QTensor.quantize` (the default tier: uint8
`weight`, fp8 `weight_scale` per 16, 0-dim fp32 `weight_scale_2`, `input_scale`, as the export
writes them). The reference is ModelOpt's `NVFP4QTensor.dequantize` of the stored tensors."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from moetune.engine.stored.formats import published_quantised
from test_train_helpers import save_tiny_model

SKIP = "*layers.0.self_attn*"  # layer 0's attention stays float: ModelOpt lists it excluded


def _modelopt() -> tuple[Any, Any, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    return mtq, export_hf_checkpoint, NVFP4QTensor


def modelopt_export(src: Path, out: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """`src` exported by ModelOpt as NVFP4 with the quantisation in hf_quant_config.json only;
    the reference: each quantised weight as `NVFP4QTensor.dequantize` gives it back (fp32)."""
    from transformers import AutoModelForCausalLM

    mtq, export, _ = _modelopt()
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    cfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    cfg["quant_cfg"].append({"quantizer_name": SKIP, "enable": False})
    calibrate = lambda m: m(torch.arange(16)[None] % m.config.vocab_size)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export(mtq.quantize(model, cfg, calibrate), export_dir=str(out))
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]  # as NVIDIA's large repos: hf_quant_config.json alone
    (out / "config.json").write_text(json.dumps(config))
    for extra in src.glob("*token*"):
        (out / extra.name).write_bytes(extra.read_bytes())
    return out, modelopt_reference(out)


def modelopt_reference(out: Path) -> dict[str, torch.Tensor]:
    """Each quantised weight of `out` as ModelOpt's `NVFP4QTensor.dequantize` reads it."""
    qtensor, tensors, ref = _modelopt()[2], load_file(str(out / "model.safetensors")), {}
    for key, scale in tensors.items():
        if key.endswith(".weight_scale"):
            base = key.removesuffix("_scale")
            packed = tensors[base]
            q = qtensor(torch.Size((packed.shape[0], packed.shape[1] * 2)), torch.float32, packed)
            ref[base] = q.dequantize(torch.float32, scale=scale, block_sizes={-1: 16},
                                     double_scale=tensors[f"{base}_scale_2"])  # fmt: skip
    return ref


def modelopt_layout(src: Path, out: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """`src` in the export's layout, each Linear quantised by `NVFP4QTensor.quantize` (not the
    router, lm_head, embeddings, nor layer 0's attention), with the hf_quant_config.json the
    export writes for it."""
    qtensor = _modelopt()[2]
    out.mkdir(parents=True)
    tensors, exclude = {}, ["lm_head", "model.embed_tokens"]
    for key, w in load_file(str(src / "model.safetensors")).items():
        base = key.removesuffix(".weight")
        if ".layers.0.self_attn." in key and key.endswith("proj.weight"):
            exclude.append(base)
        if not key.endswith("proj.weight") or not published_quantised(key) or base in exclude:
            tensors[key] = w
            continue
        q, scale, scale_2 = qtensor.quantize(w.float(), 16)
        tensors |= {key: q._quantized_data, f"{base}.weight_scale": scale,
                    f"{base}.weight_scale_2": scale_2.reshape(()),
                    f"{base}.input_scale": torch.tensor(1.0)}  # fmt: skip
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for extra in src.iterdir():  # config.json as in NVIDIA's repos: no quantization_config
        if extra.name != "model.safetensors":
            (out / extra.name).write_bytes(extra.read_bytes())
    quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
             "exclude_modules": exclude}  # fmt: skip
    hf_quant = {"producer": {"name": "modelopt", "version": "0.47.0"}, "quantization": quant}
    (out / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return out, modelopt_reference(out)


@pytest.fixture(scope="module",
                params=["layout", pytest.param("export", marks=pytest.mark.slow)])  # fmt: skip
def nvfp4(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("hfq")
    src = save_tiny_model(root / "float", moe_intermediate_size=16)  # NVFP4 blocks of 16
    write = modelopt_export if request.param == "export" else modelopt_layout
    return write(src, root / "nvfp4")


def test_spec_reads_hf_quant_config(nvfp4: tuple[Path, dict[str, torch.Tensor]]) -> None:
    from moetune.engine.stored.formats import stored_format
    from moetune.engine.stored.nvfp4 import NVFP4
    from moetune.model import load_spec

    qcfg = load_spec(str(nvfp4[0])).quant_config
    assert "quantization_config" not in json.loads((nvfp4[0] / "config.json").read_text())
    assert qcfg is not None and qcfg["quant_method"] == "modelopt"
    assert qcfg["quant_algo"] == "NVFP4" and qcfg["group_size"] == 16
    excluded = qcfg["exclude_modules"]
    assert "lm_head" in excluded and any("layers.0.self_attn" in m for m in excluded)
    assert stored_format(qcfg) is NVFP4


def test_config_json_own_quantization_config_wins(tmp_path: Path) -> None:
    from moetune.model.hf_config import with_hf_quant_config

    own = {"quantization_config": {"quant_method": "fp8"}}
    hf_quant = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4"}}
    assert with_hf_quant_config(own, hf_quant) == own
    assert with_hf_quant_config({}, hf_quant)["quantization_config"] == {
        "quant_method": "modelopt", "quant_algo": "NVFP4"}  # fmt: skip
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
    out, _ = modelopt_layout(src, tmp_path / "nvfp4")
    spec = load_spec(str(out))
    cfg = parse_config({"model": {"id": str(out)}, "lora": {"engine": "moetune"}})
    step = Step.from_config(cfg, spec)
    assert step.stored_experts == "nvfp4" and step.stored_linear_params == 1536  # layer 1's
    files, scale_2 = _kept_bytes(out)
    # the plan counts scales per 16 values; the 0-dim second-level scales are its slack
    assert abs(frozen_bytes(spec, step) - files) <= scale_2


@pytest.mark.slow  # a fake-tensor trace: ~14 s on 2 cores
def test_traced_frozen_bytes_are_the_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trace builds the excluded Linears float too (its stored_config)."""
    from moetune.config import parse_config
    from moetune.model import load_spec
    from moetune.plan import make_plan

    monkeypatch.setenv("MOETUNE_CACHE_DIR", str(tmp_path / "cache"))
    src = save_tiny_model(tmp_path / "float", dtype="bfloat16", moe_intermediate_size=16)
    out, _ = modelopt_layout(src, tmp_path / "nvfp4")
    cfg = parse_config({"model": {"id": str(out)}, "lora": {"engine": "moetune"},
                        "train": {"seq_len": 32}})  # fmt: skip
    plan = make_plan(load_spec(str(out)), cfg, cards=["h100-80gb"], estimator="trace")
    files, scale_2 = _kept_bytes(out)
    assert abs(plan.components["frozen_weights"] - files) <= scale_2


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


def test_bundled_entry_carries_its_hf_quant_config(monkeypatch: pytest.MonkeyPatch) -> None:
    import moetune.model.sources as sources

    quant = {"producer": {"name": "modelopt"},
             "quantization": {"quant_algo": "NVFP4", "group_size": 16}}  # fmt: skip
    meta = {"id": "nvidia/Tiny-NVFP4", "hf_quant_config": quant}
    config = {"model_type": "qwen3_moe", "_moetune": meta}
    monkeypatch.setattr(sources, "_catalog", lambda: {"nvidia/Tiny-NVFP4": config})
    _, raw = sources.resolve_config("nvidia/Tiny-NVFP4")
    assert raw["quantization_config"] == {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                          "group_size": 16}  # fmt: skip
    assert "quantization_config" not in config  # the bundled entry itself is left as it is
