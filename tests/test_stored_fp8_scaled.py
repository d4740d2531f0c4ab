"""Per-tensor (AutoFP8: quant_method fp8 with no weight_block_size, a 0-dim `weight_scale`) and
per-channel (fbgemm_fp8: `weight_scale` [out, 1]) FP8, read as stored: W = weight × scale in
fp32, equal bit for bit to transformers' `_dequantize_fp8_weight` (no block) and to a float64
reference; a run over such a base equals a run over its publisher-dequantised fp32 copy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moetune.engine.quant.stacks import stacks_of
from moetune.engine.stored.formats import stored_format
from moetune.engine.stored.fp8 import BlockFP8
from moetune.engine.stored.fp8_scaled import ScaledFP8
from moetune.engine.stored.linear import StoredLinear
from moetune.engine.stored.load import load_stored
from test_train_helpers import one_thread, reverse_rows, run_config, save_tiny_model, write_jsonl

pytestmark = pytest.mark.filterwarnings("ignore")
CONFIGS = {
    "tensor": {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
    "channel": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                "modules_to_not_convert": ["lm_head"]},
}  # fmt: skip
FLOAT_KEPT = ("embed_tokens", "lm_head", "norm", "mlp.gate.")


def reference_quantize(w: torch.Tensor, per: str) -> tuple[torch.Tensor, torch.Tensor]:
    """amax / 448 in float64 (the whole tensor: a 0-dim scale; each row: [out, 1]), rounded."""
    w64 = w.double()
    amax = w64.abs().max() if per == "tensor" else w64.abs().amax(dim=1, keepdim=True)
    scale = (amax / 448.0).float()
    return (w64 / scale.double()).to(torch.float8_e4m3fn), scale


def reference_dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The exact float64 product, rounded once to fp32 (an fp32 multiply)."""
    return (q.double() * scale.double()).float()


@pytest.mark.parametrize("per", ["tensor", "channel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_equals_transformers_and_the_reference(per: str, dtype: torch.dtype) -> None:
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    w = torch.randn(24, 40, generator=torch.Generator().manual_seed(0)) * 0.3
    q, scale = reference_quantize(w, per)
    bufs = {"weight": q[None], "scale": scale.reshape(1, 1) if per == "tensor" else scale[None]}
    ScaledFP8.check(bufs, (24, 40), "q_proj")
    mine = ScaledFP8.dequantize(bufs, (24, 40), dtype)[0]
    assert torch.equal(mine, reference_dequant(q, scale).to(dtype))
    if dtype == torch.float32:  # transformers computes in the output dtype: right in fp32 only
        assert torch.equal(mine, _dequantize_fp8_weight(q, scale, None, torch.float32))
    assert torch.equal(ScaledFP8.quantize(w[None], per=per)["weight"][0].float(), q.float())


def test_read_by_their_quantization_config() -> None:
    assert stored_format(CONFIGS["tensor"]) is ScaledFP8
    assert stored_format(CONFIGS["channel"]) is ScaledFP8
    assert issubclass(stored_format({"quant_method": "fp8", "weight_block_size": [128, 128]}),  # type: ignore[arg-type]
                      BlockFP8)  # fmt: skip


def _publish(src: Path, out: Path, per: str) -> dict[str, torch.Tensor]:
    """`src` as AutoFP8 / fbgemm write it (a static input_scale too for AutoFP8); every
    quantised weight dequantised by the reference, by its float key."""
    tensors, ref = {}, {}
    for key, value in load_file(str(src / "model.safetensors")).items():
        if value.ndim != 2 or any(k in key for k in FLOAT_KEPT):
            tensors[key] = value
            continue
        q, scale = reference_quantize(value, per)
        base = key.removesuffix(".weight")
        tensors[f"{base}.weight"], tensors[f"{base}.weight_scale"] = q, scale
        if per == "tensor":
            tensors[f"{base}.input_scale"] = torch.tensor(0.02)
        ref[key] = reference_dequant(q, scale)
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": CONFIGS[per]}))
    for extra in src.glob("*token*"):
        shutil.copy2(extra, out / extra.name)
    return ref


def _copy(src: Path, ref: dict[str, torch.Tensor], out: Path) -> Path:
    state = {k: ref.get(k, v) for k, v in load_file(str(src / "model.safetensors")).items()}
    out.mkdir()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for extra in [src / "config.json", *src.glob("*token*")]:
        shutil.copy2(extra, out / extra.name)
    return out


@pytest.fixture(scope="module")
def float_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("scaled") / "float")


@pytest.mark.parametrize("per", ["tensor", "channel"])
def test_loaded_and_trained_as_stored(float_base: Path, tmp_path: Path, per: str) -> None:
    from moetune.train import train

    ref = _publish(float_base, tmp_path / "fp8", per)
    model, report = load_stored(tmp_path / "fp8", "cpu", torch.float32, keep_linears=True)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, StoredLinear)}
    assert report.format == "fp8_scaled" and report.stacks == 4 and linears
    for name, module in linears.items():
        assert torch.equal(module.stored.expert(0, torch.float32), ref[f"{name}.weight"]), name
    stack = stacks_of(model.get_submodule("model.layers.1.mlp.experts"))["gate_up_proj"]
    key = "model.layers.1.mlp.experts.2.{}_proj.weight"
    want = torch.cat([ref[key.format("gate")], ref[key.format("up")]])
    assert torch.equal(stack.canonical_expert(2, torch.float32), want)

    data = write_jsonl(tmp_path / "d.jsonl", reverse_rows(16))
    adapters = []
    for base in (tmp_path / "fp8", _copy(float_base, ref, tmp_path / "copy")):
        cfg = run_config(base, data, tmp_path / f"run-{base.name}", max_steps=2, save_steps=2,
                         lora__targets=["attention", "experts"])  # fmt: skip
        with one_thread():
            train(cfg, progress=False)
        adapters.append(
            load_file(str(next(Path(cfg.output.dir).rglob("adapter_model.safetensors"))))
        )
    stored, plain = adapters
    assert stored.keys() == plain.keys()
    for name, value in plain.items():
        rel = float((stored[name] - value).norm() / value.norm().clamp_min(1e-30))
        assert rel <= 1e-5, (name, rel)
