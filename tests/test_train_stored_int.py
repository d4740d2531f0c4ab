"""Tiny qwen3_moe bases published as GPTQ (asymmetric, desc_act, v1 zeros; experts stored per
expert as Qwen3-30B-A3B-GPTQ-Int4 does) and as compressed-tensors INT4 with zero points and
`actorder: group` (written by compressed-tensors' own compressor) train through `moetune
train` with experts and attention kept as stored; each adapter equals a run over the same
weights dequantised by the publisher's reference (the GPTQ kernels' formula in float64;
compressed-tensors' `decompress`), saved fp32, to 1e-5."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moetune.engine.stored.formats import published_quantised
from test_engine_stored_int import _ct, _nibbles_packed
from test_train_helpers import one_thread, reverse_rows, run_config, save_tiny_model, write_jsonl

pytestmark = pytest.mark.filterwarnings("ignore")
GROUP, BITS = 16, 4


def _gptq(w: torch.Tensor, order: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """GPTQ tensors of a weight [out, in] (round to nearest, asymmetric, groups formed in
    `order` as desc_act does, v1 zeros) and the kernels' dequantised weight in float64."""
    out, inp = w.shape
    g_idx = torch.empty(inp, dtype=torch.int64)
    g_idx[order] = torch.arange(inp) // GROUP
    grouped = w.double().T[order].reshape(inp // GROUP, GROUP, out)
    lo, hi = grouped.amin(1).clamp(max=0), grouped.amax(1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp_min(1e-6).to(torch.float16)  # [groups, out]
    zeros = torch.round(-lo / scales.double()).clamp(1, 15).long()
    codes = torch.round(w.double().T / scales.double()[g_idx] + zeros[g_idx]).clamp(0, 15).long()
    tensors = {"qweight": _nibbles_packed(codes.T, BITS).T.contiguous(),
               "qzeros": _nibbles_packed(zeros - 1, BITS), "scales": scales,
               "g_idx": g_idx.to(torch.int32)}  # fmt: skip
    return tensors, (scales.double()[g_idx] * (codes - zeros[g_idx]).double()).T


def _ct_int4(w: torch.Tensor, order: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors' own compressor, asymmetric, actorder group (g_idx from `order`)."""
    return _ct(w, BITS, GROUP, False, order)


CT_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": BITS, "type": "int", "symmetric": False, "strategy": "group",
        "group_size": GROUP, "actorder": "group"}}},
    "ignore": ["lm_head", "re:.*mlp.gate$"],
}  # fmt: skip
GPTQ_CONFIG = {"quant_method": "gptq", "bits": BITS, "group_size": GROUP, "desc_act": True,
               "sym": False, "checkpoint_format": "gptq"}  # fmt: skip
WRITERS = {"gptq": (_gptq, GPTQ_CONFIG), "int4-zp-gidx": (_ct_int4, CT_CONFIG)}


def write_published(src: Path, out: Path, copy: Path, method: str) -> None:
    """`src` published as `method` under `out`, its reference dequantisation (fp32) in `copy`."""
    quantise, qcfg = WRITERS[method]
    stored, ref = {}, {}
    gen = torch.Generator().manual_seed(0)
    with safe_open(str(next(src.glob("*.safetensors"))), "pt") as f:
        for key in f.keys():  # noqa: SIM118 (a safe_open handle)
            t = f.get_tensor(key)
            if t.ndim == 2 and key.endswith(".weight") and published_quantised(key):
                base = key.removesuffix(".weight")
                tensors, weight = quantise(t, torch.randperm(t.shape[1], generator=gen))
                stored |= {f"{base}.{k}": v.contiguous() for k, v in tensors.items()}
                ref[key] = weight.float().contiguous()
            else:
                stored[key], ref[key] = t.to(torch.float16), t.float()
    config = json.loads((src / "config.json").read_text())
    for d, tensors in ((out, stored), (copy, ref)):
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        for extra in src.iterdir():
            if extra.suffix not in (".safetensors", ".json") or "token" in extra.name:
                shutil.copy2(extra, d / extra.name)
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": qcfg}))
    (copy / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))


def test_an_undeclared_g_idx_is_refused(tmp_path: Path) -> None:
    """Weights written with g_idx under a config.json without actorder: refused, not read in
    natural groups."""
    from moetune.engine.quant.stacks import QuantError
    from moetune.engine.stored.load import load_stored

    src = save_tiny_model(tmp_path / "bf16", hidden_size=64, moe_intermediate_size=32,
                          intermediate_size=64, head_dim=16, dtype="bfloat16")  # fmt: skip
    write_published(src, tmp_path / "stored", tmp_path / "copy", "int4-zp-gidx")
    config = json.loads((tmp_path / "stored" / "config.json").read_text())
    del config["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"]
    (tmp_path / "stored" / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantError, match=r"g_idx tensors that its config\.json does not declare"):
        load_stored(tmp_path / "stored", "cpu", torch.float32)


def _adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(next(run.rglob("adapter_model.safetensors"))))


CASES = [("gptq", "none"), ("int4-zp-gidx", "none"), ("gptq", "disk")]


@pytest.mark.parametrize(("method", "offload"), CASES)
def test_published_base_trains_as_its_reference_dequantisation(
    tmp_path: Path, method: str, offload: str
) -> None:
    """As stored (and streamed from disk: offload moves the stored bytes) equals the run over
    the reference-dequantised fp32 copy."""
    from moetune.engine.stored.load import load_stored
    from moetune.train import train

    src = save_tiny_model(tmp_path / "bf16", hidden_size=64, moe_intermediate_size=32,
                          intermediate_size=64, head_dim=16, dtype="bfloat16")  # fmt: skip
    write_published(src, tmp_path / "stored", tmp_path / "copy", method)
    model, report = load_stored(tmp_path / "stored", "cpu", torch.float32, keep_linears=True)
    assert (report.format, report.stacks, report.linears_stored) == (method, 4, 8)
    ref = load_file(str(tmp_path / "copy" / "model.safetensors"))
    q = model.get_submodule("model.layers.1.self_attn.q_proj")
    assert torch.equal(q.dequantized().weight, ref["model.layers.1.self_attn.q_proj.weight"])
    data = write_jsonl(tmp_path / "d.jsonl", reverse_rows(8))
    runs = {}
    with one_thread():
        for name in ("stored", "copy"):
            streamed = {"offload": offload} if name == "stored" else {}
            cfg = run_config(tmp_path / name, data, tmp_path / f"run-{name}", max_steps=2,
                             save_steps=2, lora__targets=["attention", "experts"],
                             **streamed)  # fmt: skip
            runs[name] = train(cfg, progress=False)
    assert runs["stored"].coverage == 1.0
    quant = json.loads((tmp_path / "run-stored" / "quant.json").read_text())
    assert quant["format"] == method
    mine, theirs = _adapter(tmp_path / "run-stored"), _adapter(tmp_path / "run-copy")
    assert mine.keys() == theirs.keys()
    for key, value in theirs.items():
        assert float((mine[key] - value).norm() / value.norm().clamp_min(1e-12)) < 1e-5, key
