"""compressed-tensors FP8 (`float-quantized`: RedHatAI's "-FP8-dynamic" repos, llm-compressor's
FP8 / FP8_BLOCK schemes), written by compressed-tensors' own FloatQuantizationCompressor and
read as stored: equal bit for bit to its `decompress` (tensor, channel and block scales, a
partial last block as DeepSeek's 576 rows, bf16 and fp32 scales); a tiny qwen3_moe base with
per-expert keys trains to the adapter of a run over its decompressed fp32 copy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from moetune.engine.quant.stacks import QuantError, stacks_of
from moetune.engine.stored.ct_fp8 import BlockFP8CompressedTensors, ScaledFP8CompressedTensors
from moetune.engine.stored.formats import stored_format
from moetune.engine.stored.linear import StoredLinear
from moetune.engine.stored.load import load_stored
from test_train_helpers import one_thread, reverse_rows, run_config, save_tiny_model, write_jsonl

pytestmark = pytest.mark.filterwarnings("ignore")
FLOAT_KEPT = ("embed_tokens", "lm_head", "norm", "mlp.gate.")


def ct_config(strategy: str, block: list[int] | None = None, static: bool = False,
              **weights: Any) -> dict[str, Any]:  # fmt: skip
    """The quantization_config llm-compressor saves (FP8_DYNAMIC, FP8 static, FP8_BLOCK)."""
    w = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
         "strategy": strategy, "block_structure": block, **weights}  # fmt: skip
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static,
            "strategy": "tensor" if static else "token"}  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w,
                                          "input_activations": acts}},
            "ignore": ["lm_head", "re:.*mlp.gate$"]}  # fmt: skip


def _scheme(strategy: str, block: list[int] | None) -> Any:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, block_structure=block,
                            symmetric=True, dynamic=False)  # fmt: skip
    acts = QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True)
    return QuantizationScheme(targets=["Linear"], weights=args, input_activations=acts)


def _groups(w: torch.Tensor, strategy: str, block: list[int] | None) -> torch.Tensor:
    """The weight's values a scale covers, one row a scale (blocks: zero-padded, row-major)."""
    if strategy == "tensor":
        return w.reshape(1, -1)
    if strategy == "channel":
        return w
    br, bc = block or (128, 128)
    p = F.pad(w, (0, -w.shape[1] % bc, 0, -w.shape[0] % br))
    return p.reshape(p.shape[0] // br, br, -1, bc).transpose(1, 2).flatten(2)


def ct_compress(
    w: torch.Tensor,
    strategy: str,
    block: list[int] | None = None,
    scale_dtype: torch.dtype | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A Linear's tensors as compressed-tensors' compressor saves them (scales from its own
    calculate_qparams, in the weight's dtype as llm-compressor keeps them), and its own
    `decompress` of them."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = _scheme(strategy, block)
    g = _groups(w.float(), strategy, block)
    scale, zero = calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights)
    if strategy == "channel":
        scale, zero = scale.reshape(-1, 1), zero.reshape(-1, 1)
    elif strategy == "block":
        scale, zero = scale.reshape(g.shape[:2]), zero.reshape(g.shape[:2])
    state = {"weight": w, "weight_scale": scale.to(scale_dtype or w.dtype),
             "weight_zero_point": zero}  # fmt: skip
    comp = BaseCompressor.load_from_registry("float-quantized")
    sd = comp.compress(state, scheme)
    return sd, comp.decompress(sd, scheme)["weight"]


CASES = [  # (strategy, block, [out, in])
    ("tensor", None, (72, 40)),
    ("channel", None, (72, 40)),
    ("block", [128, 128], (576, 160)),  # DeepSeek's kv_a_proj_with_mqa rows: 4½ blocks
    ("block", [16, 32], (40, 72)),
]


@pytest.mark.parametrize(("strategy", "block", "shape"), CASES)
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_dequantize_equals_compressed_tensors_decompress(
    strategy: str, block: list[int] | None, shape: tuple[int, int], scale_dtype: torch.dtype
) -> None:
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    sd, ref = ct_compress(w, strategy, block, scale_dtype)
    fmt = stored_format(ct_config(strategy, block))
    assert fmt is not None
    bufs = {b: sd[s].unsqueeze(0) for b, (s, _) in fmt.keys.items()}
    if strategy == "tensor":  # [1] as saved, [E, 1] as the loader stacks it
        assert sd["weight_scale"].shape == (1,)
        bufs["scale"] = sd["weight_scale"].reshape(1, 1)
    fmt.check(bufs, shape, "test")
    assert ref.dtype == scale_dtype
    for dtype in (scale_dtype, torch.float32):
        got = fmt.dequantize(bufs, shape, dtype)[0]
        assert got.dtype == dtype and torch.equal(got, ref.to(dtype))


def test_a_zero_dim_scale_reads_as_one_a_tensor() -> None:
    w = torch.randn(24, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    sd, ref = ct_compress(w, "tensor")
    fmt = ScaledFP8CompressedTensors
    bufs = {"weight": sd["weight"][None], "scale": sd["weight_scale"].reshape(()).reshape(1, 1)}
    assert torch.equal(fmt.dequantize(bufs, (24, 32), torch.bfloat16)[0], ref)


def test_read_by_their_quantization_config() -> None:
    for strategy in ("tensor", "channel"):
        for static in (False, True):  # the activation scheme does not change the weights
            assert stored_format(ct_config(strategy, static=static)) is ScaledFP8CompressedTensors
    block = stored_format(ct_config("block", [128, 128]))
    assert block is BlockFP8CompressedTensors
    other = stored_format(ct_config("block", [64, 32]))
    assert other is not None and issubclass(other, BlockFP8CompressedTensors)
    assert other.block == (64, 32) and other.keys["scale_inv"][0] == "weight_scale"  # type: ignore[attr-defined]
    assert stored_format(ct_config("block", [64, 32])) is other  # one class a block size
    assert BlockFP8CompressedTensors.bytes_per_param(ct_config("block", [64, 32])) == 1 + 4 / 2048


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"dynamic": True}, "dynamic weight scales"),
        ({"num_bits": 4}, "4-bit floats"),
        ({"strategy": "group", "group_size": 128}, "strategy group"),
        ({"symmetric": False}, "weight zero points"),
        ({"strategy": "block", "block_structure": None}, "block without block_structure"),
    ],
)
def test_schemes_not_read_are_refused_in_one_line(change: dict[str, Any], named: str) -> None:
    config = ct_config("channel")
    config["config_groups"]["group_0"]["weights"].update(change)
    with pytest.raises(QuantError, match=named) as exc:
        stored_format(config)
    assert "\n" not in exc.value.cause and exc.value.fix


def test_mixed_formats_are_refused() -> None:
    config = ct_config("channel")
    config["config_groups"]["group_1"] = {**config["config_groups"]["group_0"],
                                          "format": "pack-quantized"}  # fmt: skip
    with pytest.raises(QuantError, match="mixed formats"):
        stored_format(config)


def test_the_plan_sizes_what_is_stored_and_honours_ignore() -> None:
    from moetune.plan.fit import analytic
    from moetune.plan.step import Step
    from test_plan_stored import ROUTED, run, small

    quant = ct_config("channel")
    spec = small(quant)
    step = Step.from_config(run(), spec)
    assert step.stored_bytes == 1 + 4 / 1024 and step.split_lora
    assert step.stored_linear_bytes == step.stored_bytes  # attention stored too
    frozen = analytic(spec, run()).components["frozen_weights"]
    attention = spec.components.attention
    assert frozen == (ROUTED + attention) * step.stored_bytes + (
        spec.total_params - ROUTED - attention) * 2  # fmt: skip
    kept = small({**quant, "ignore": ["lm_head", "re:.*self_attn.*"]})
    step = Step.from_config(run(), kept)
    assert step.stored_linear_bytes == 0
    frozen = analytic(kept, run()).components["frozen_weights"]
    assert frozen == ROUTED * step.stored_bytes + (kept.total_params - ROUTED) * 2


def _publish(src: Path, out: Path, copy: Path, strategy: str, block: list[int] | None) -> None:
    """`src` as llm-compressor saves it (per-expert keys as Qwen3-30B-A3B-FP8-dynamic; a static
    input_scale beside each weight for the static scheme), and compressed-tensors'
    decompression of it saved fp32 in `copy`."""
    tensors, ref = {}, {}
    for key, value in load_file(str(src / "model.safetensors")).items():
        ref[key] = value.float()
        if value.ndim != 2 or any(k in key for k in FLOAT_KEPT):
            tensors[key] = value
            continue
        base = key.removesuffix(".weight")
        sd, deq = ct_compress(value, strategy, block)
        tensors |= {f"{base}.{k}": v for k, v in sd.items()}
        if strategy == "tensor":  # static activations: unused to train
            tensors[f"{base}.input_scale"] = torch.tensor([0.02], dtype=value.dtype)
            if ".layers.0." in key:  # a 0-dim scale (older writers) loads as [1] does
                tensors[f"{base}.weight_scale"] = tensors[f"{base}.weight_scale"].reshape(())
        ref[key] = deq.float()
    config = json.loads((src / "config.json").read_text())
    qcfg = ct_config(strategy, block, static=strategy == "tensor")
    for d, state, extra in ((out, tensors, {"quantization_config": qcfg}),
                            (copy, ref, {"dtype": "float32"})):  # fmt: skip
        d.mkdir()
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps({**config, **extra}))
        for tok in src.glob("*token*"):
            shutil.copy2(tok, d / tok.name)


@pytest.mark.parametrize(("strategy", "block"), [("tensor", None), ("channel", None),
                                                 ("block", [16, 32])])  # fmt: skip
def test_a_published_base_trains_as_its_decompressed_copy(
    tmp_path: Path, strategy: str, block: list[int] | None
) -> None:
    from moetune.train import train

    src = save_tiny_model(tmp_path / "bf16", hidden_size=64, moe_intermediate_size=32,
                          intermediate_size=64, head_dim=16, dtype="bfloat16")  # fmt: skip
    _publish(src, tmp_path / "stored", tmp_path / "copy", strategy, block)
    model, report = load_stored(tmp_path / "stored", "cpu", torch.float32, keep_linears=True)
    name = "fp8-ct-block" if block else "fp8-ct"
    assert (report.format, report.stacks) == (name, 4) and report.linears_stored == 8
    ref = load_file(str(tmp_path / "copy" / "model.safetensors"))
    for path, module in model.named_modules():
        if isinstance(module, StoredLinear):
            assert torch.equal(module.stored.expert(0, torch.float32), ref[f"{path}.weight"])
    stack = stacks_of(model.get_submodule("model.layers.1.mlp.experts"))["gate_up_proj"]
    key = "model.layers.1.mlp.experts.2.{}_proj.weight"
    want = torch.cat([ref[key.format("gate")], ref[key.format("up")]])
    assert torch.equal(stack.canonical_expert(2, torch.float32), want)

    data = write_jsonl(tmp_path / "d.jsonl", reverse_rows(8))
    adapters = {}
    with one_thread():
        for base in ("stored", "copy"):
            cfg = run_config(tmp_path / base, data, tmp_path / f"run-{base}", max_steps=2,
                             save_steps=2, lora__targets=["attention", "experts"])  # fmt: skip
            train(cfg, progress=False)
            adapters[base] = load_file(
                str(next((tmp_path / f"run-{base}").rglob("adapter_model.safetensors")))
            )
    quant = json.loads((tmp_path / "run-stored" / "quant.json").read_text())
    assert quant["format"] == name
    mine, theirs = adapters["stored"], adapters["copy"]
    assert mine.keys() == theirs.keys() and theirs
    for k, value in theirs.items():
        assert float((mine[k] - value).norm() / value.norm().clamp_min(1e-12)) < 1e-5, k


def test_scales_of_another_block_are_refused_naming_block_structure() -> None:
    """Scales made over 32x32 blocks under a config that says 16x32: refused, never read."""
    w = torch.randn(40, 72, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    sd, _ = ct_compress(w, "block", [32, 32])
    fmt = stored_format(ct_config("block", [16, 32]))
    assert fmt is not None
    bufs = {"weight": sd["weight"][None], "scale_inv": sd["weight_scale"][None]}
    with pytest.raises(QuantError, match="block_structure") as exc:
        fmt.check(bufs, (40, 72), "model.layers.0.self_attn.q_proj")
    assert "block_structure" in exc.value.fix and "weight_block_size" not in exc.value.fix
