"""Block FP8 as DeepSeek publishes it, at DeepSeek's real attention widths: `kv_a_proj_with_mqa`
has kv_lora_rank 512 + qk_rope_head_dim 64 = 576 rows, 4 whole 128-row blocks and a partial
one, and hidden 200 leaves a partial column block everywhere. The fixture is quantised here by
an independent float64 quantiser following DeepSeek's semantics (amax / 448 per 128x128 block,
a ceil-divided fp32 `weight_scale_inv` grid), and moetune's weights are compared bit for bit
with a float64 implementation of DeepSeek's `weight_dequant` (inference/kernel.py:
y[i, j] = x[i, j] · s[i // 128, j // 128], the product rounded once to fp32)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moetune.engine.quant.stacks import QuantError, stacks_of
from moetune.engine.stored.formats import stored_format
from moetune.engine.stored.linear import StoredLinear
from moetune.engine.stored.load import load_stored
from test_train_helpers import one_thread, reverse_rows, run_config, write_jsonl

pytestmark = pytest.mark.filterwarnings("ignore")
BLOCK = 128
QCFG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK]}  # fmt: skip
# DeepSeek-V3's attention widths (heads cut to 2), a small hidden that 128 does not divide
WIDTHS = {"hidden_size": 200, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
          "qk_nope_head_dim": 128, "v_head_dim": 128, "num_attention_heads": 2,
          "num_key_value_heads": 2, "intermediate_size": 256, "moe_intermediate_size": 128,
          "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
          "first_k_dense_replace": 1, "num_hidden_layers": 2, "n_group": 1, "topk_group": 1,
          "max_position_embeddings": 64}  # fmt: skip
FLOAT_KEPT = ("embed_tokens", "lm_head", "norm", "mlp.gate.")  # DeepSeek leaves these in float


def reference_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block FP8 of a [out, in] weight in float64: per 128x128 block (the last ones
    partial) scale = amax / 448 as fp32, weight = e4m3(w / scale)."""
    out, inp = w.shape
    rows, cols = -(-out // BLOCK), -(-inp // BLOCK)
    w64 = w.double()
    scale = torch.empty(rows, cols, dtype=torch.float32)
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            block = w64[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK]
            scale[i, j] = (block.abs().max().clamp_min(1e-12) / 448.0).float()
            q[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] = (
                block / scale[i, j].double()
            ).to(torch.float8_e4m3fn)
    return q, scale


def weight_dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """DeepSeek's weight_dequant in float64: each 128x128 tile (masked at the edges) times its
    scale s[i // 128, j // 128]; the exact float64 product rounded once to fp32, as the
    kernel's fp32 multiply rounds it."""
    out, inp = q.shape
    assert scale.shape == (-(-out // BLOCK), -(-inp // BLOCK))
    y = torch.empty(out, inp, dtype=torch.float64)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = (slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK))
            y[tile] = q[tile].double() * scale[i, j].double()
    return y.float()


def _publish(src: Path, out: Path) -> dict[str, torch.Tensor]:
    """`src` rewritten as DeepSeek ships it; returns every quantised weight dequantised by the
    reference (by its float key) – the publisher's own values."""
    tensors, ref = {}, {}
    for key, value in load_file(str(src / "model.safetensors")).items():
        if value.ndim != 2 or any(k in key for k in FLOAT_KEPT):
            tensors[key] = value
            continue
        q, scale = reference_quantize(value)
        base = key.removesuffix(".weight")
        tensors[f"{base}.weight"], tensors[f"{base}.weight_scale_inv"] = q, scale
        ref[key] = weight_dequant(q, scale)
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": QCFG}))
    _tokenizer(src, out)
    return ref


def _tokenizer(src: Path, out: Path) -> None:
    for extra in src.glob("*token*"):
        shutil.copy2(extra, out / extra.name)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A float tiny DeepSeek-V3, its FP8 release, and the release dequantised by the publisher's
    semantics saved in fp32 (the reference base)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from moetune.demo.tokenizer import build_tokenizer

    root = tmp_path_factory.mktemp("deepseek")
    tok = build_tokenizer()
    config = DeepseekV3Config(vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                              eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                              **WIDTHS)  # fmt: skip
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).float()
    with torch.no_grad():  # weights of a trained model's spread, so the blocks' scales differ
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                p.mul_(torch.rand(p.shape[0], 1) * 4 + 0.1)
    model.save_pretrained(root / "float")
    tok.save_pretrained(root / "float")
    ref = _publish(root / "float", root / "fp8")
    copy = root / "copy"
    state = {
        k: ref.get(k, v) for k, v in load_file(str(root / "float" / "model.safetensors")).items()
    }
    copy.mkdir()
    save_file(state, str(copy / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy2(root / "float" / "config.json", copy / "config.json")
    _tokenizer(root / "float", copy)
    data = write_jsonl(root / "d.jsonl", reverse_rows(16))
    return {"fp8": root / "fp8", "copy": copy, "ref": ref, "data": data}


def test_block_size_is_the_configs_not_the_grids() -> None:
    fmt = stored_format(QCFG)
    assert fmt is not None and fmt.block == (128, 128)  # type: ignore[attr-defined]
    other = stored_format({**QCFG, "weight_block_size": [64, 32]})
    assert other.block == (64, 32)  # type: ignore[union-attr]


def test_stored_weights_equal_deepseeks_weight_dequant(deepseek: dict) -> None:
    """Every StoredLinear (576-row kv_a_proj_with_mqa included) and every expert bit for bit."""
    ref = deepseek["ref"]
    model, report = load_stored(deepseek["fp8"], "cpu", torch.float32, keep_linears=True)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, StoredLinear)}
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa" in linears and report.linears_stored
    for name, module in linears.items():
        assert torch.equal(module.stored.expert(0, torch.float32), ref[f"{name}.weight"]), name
    stacks = stacks_of(model.get_submodule("model.layers.1.mlp.experts"))
    key = "model.layers.1.mlp.experts.{}.{}_proj.weight"
    for e in range(4):
        gate_up = torch.cat([ref[key.format(e, "gate")], ref[key.format(e, "up")]])
        assert torch.equal(stacks["gate_up_proj"].canonical_expert(e, torch.float32), gate_up)
        down = stacks["down_proj"].canonical_expert(e, torch.float32)
        assert torch.equal(down, ref[key.format(e, "down")])


def test_dequantized_at_load_equals_weight_dequant(deepseek: dict) -> None:
    """The merged export's and `quantized_base: dequantize`'s path: dequantised as it streams."""
    model, report = load_stored(deepseek["fp8"], "cpu", torch.float32)
    params = dict(model.named_parameters())
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in report.dequantized
    for name in report.dequantized:
        assert torch.equal(params[name], deepseek["ref"][name]), name


def test_divides_by_accident_is_exact() -> None:
    """kv_lora_rank 128 + rope 64 = 192 rows: a grid of 2 rows, whose quotient (96) is not the
    block – the rows 96..127 take the first row of scales, as DeepSeek's kernel reads them."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(192, 200, generator=g) * (torch.rand(192, 1, generator=g) * 4 + 0.1)
    q, scale = reference_quantize(w)
    fmt = stored_format(QCFG)
    assert fmt is not None and scale.shape == (2, 2)
    bufs = {"weight": q[None], "scale_inv": scale[None]}
    fmt.check(bufs, (192, 200), "kv_a_proj_with_mqa")
    assert torch.equal(fmt.dequantize(bufs, (192, 200), torch.float32)[0], weight_dequant(q, scale))
    assert torch.equal(fmt.quantize(w[None])["weight"][0].float(), q.float())  # same bytes


def test_a_grid_not_ceil_divided_is_refused() -> None:
    fmt = stored_format(QCFG)
    assert fmt is not None
    bufs = {"weight": torch.zeros(1, 576, 200).to(torch.float8_e4m3fn),
            "scale_inv": torch.ones(1, 4, 2)}  # fmt: skip
    with pytest.raises(
        QuantError, match=r"grid \[4, 2\] is not ceil\(\[576, 200\] / \[128, 128\]\)"
    ):
        fmt.check(bufs, (576, 200), "kv_a_proj_with_mqa")


def _adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(next(run.rglob("adapter_model.safetensors"))))


RUNS = [("as_stored", "none"), ("dequantize", "none"), ("as_stored", "disk")]


@pytest.mark.parametrize(("quantized_base", "offload"), RUNS)
def test_run_over_the_stored_base_equals_the_publishers_float(
    deepseek: dict, tmp_path: Path, quantized_base: str, offload: str
) -> None:
    """Offloaded to disk, the stacks are read from the checkpoint per step (the configured
    block travels with them)."""
    from moetune.train import train

    def run(base: Path, out: Path) -> dict[str, torch.Tensor]:
        cfg = run_config(base, deepseek["data"], out, lora__targets=["attention", "experts"],
                         max_steps=2, save_steps=2)  # fmt: skip
        if base == deepseek["fp8"]:
            cfg.model.quantized_base = quantized_base
            cfg.train.offload = offload
        with one_thread():
            train(cfg, progress=False)
        return _adapter(out)

    stored, plain = run(deepseek["fp8"], tmp_path / "stored"), run(deepseek["copy"], tmp_path / "f")
    assert stored.keys() == plain.keys() and any("kv_a_proj_with_mqa" in k for k in stored)
    for name, value in plain.items():
        rel = float((stored[name] - value).norm() / value.norm().clamp_min(1e-30))
        assert rel <= 1e-5, (name, rel)


def test_merged_export_is_the_publishers_weights_plus_delta(deepseek: dict, tmp_path: Path) -> None:
    """The merge over the FP8 base equals the publisher-dequantised base + ΔW, the partial-block
    kv_a_proj_with_mqa (an adapter target here) and the experts included."""
    import transformers

    from export_fixtures import make_adapter
    from moetune.export import ExportOptions, resolve_source, run_export
    from moetune.export.deltas import delta, iter_deltas

    adapter = make_adapter(deepseek["copy"], tmp_path / "adapter", 0.05,
                           modules=["kv_a_proj_with_mqa", "o_proj"])  # fmt: skip
    source = resolve_source(adapter, str(deepseek["fp8"]))
    run_export(source, "merged", tmp_path / "out", ExportOptions(dtype="float32"))  # type: ignore[arg-type]

    def params(path: Path) -> dict[str, torch.Tensor]:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        return {k: v.detach().clone() for k, v in model.named_parameters()}

    want, got = params(deepseek["copy"]), params(tmp_path / "out")
    targets = set()
    for target, a, b in iter_deltas(adapter, str(deepseek["copy"]), torch.float32):
        want[target.param] += delta(target, a, b)
        targets.add(target.param)
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in targets
    assert any(".experts." in t for t in targets)
    for name, value in want.items():
        rel = float((got[name] - value).norm() / value.norm())
        assert rel < 1e-6, (name, rel)


def test_fused_projections_ending_in_a_partial_block_refused() -> None:
    """gate and up of 100 rows each fused into one stack: ceil(200 / 128) = 2 scale rows, as
    many as the two per-projection grids hold, yet rows 100..127 would take gate's scale for
    up's rows – refused, never read wrongly."""
    from moetune.engine.stored.load import _fusable

    fmt = stored_format(QCFG)
    assert fmt is not None
    _fusable(fmt, 2, (256, 200), "experts.gate_up_proj")  # 128-row projections: whole blocks
    with pytest.raises(QuantError, match="partial 128-row block") as err:
        _fusable(fmt, 2, (200, 200), "experts.gate_up_proj")
    assert "bf16 release" in err.value.fix


def test_requantized_export_keeps_deepseeks_ceil_grid(deepseek: dict, tmp_path: Path) -> None:
    """--requantize writes the merge back as published: 576 rows keep a grid of 5."""
    from export_fixtures import make_adapter
    from moetune.export import ExportOptions, resolve_source, run_export

    adapter = make_adapter(deepseek["copy"], tmp_path / "adapter", 0.05,
                           modules=["kv_a_proj_with_mqa"])  # fmt: skip
    source = resolve_source(adapter, str(deepseek["fp8"]))
    opts = ExportOptions(extra={"requantize": True, "survival_floor": 0.0})  # type: ignore[call-arg]
    run_export(source, "merged", tmp_path / "out", opts)
    files = [load_file(str(f)) for f in (tmp_path / "out").glob("*.safetensors")]
    written = {k: v for f in files for k, v in f.items()}
    key = "model.layers.0.self_attn.kv_a_proj_with_mqa"
    assert written[f"{key}.weight"].shape == (576, 200)
    assert written[f"{key}.weight_scale_inv"].shape == (5, 2)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
