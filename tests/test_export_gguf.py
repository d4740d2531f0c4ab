"""`--format gguf`: read back with gguf.GGUFReader, every tensor name and shape is what
llama.cpp's loader and build_lora_mm_id expect, and alpha/r · B@A per expert equals peft's
own ΔW (float64) – for qwen3_moe (halves), gpt_oss (interleaved, transposed), olmoe,
mixtral and granitemoe (LLAMA-style converters: q/k rows in the rope order, k by kv heads)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from peft import PeftModel
from peft.tuners.lora.layer import LoraLayer

from export_fixtures import FAMILIES, make_adapter, make_base
from moetune.export import ExportError, ExportOptions, resolve_source, run_export
from moetune.export.check import ConsumerUnavailable
from moetune.export.llamacpp import run_llamacpp

pytestmark = pytest.mark.filterwarnings("ignore")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
GGUF_ATTN = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output"}
ARCH = {"qwen3_moe-dense0": "qwen3moe", "gpt_oss": "gpt-oss", "olmoe": "olmoe", "mixtral": "llama",
        "granitemoe-bias": "granitemoe"}  # fmt: skip
GRANITE_EXPERTS = ["block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.experts.down_proj"]
PERMUTED = {"mixtral", "granitemoe"}  # LLAMA-style converters


def _rope_order(rows: int, n_head: int) -> list[int]:
    """Row i of the converted q/k is row order[i] of transformers' (conversion/llama.py
    LlamaModel.permute): per head of d rows, the halves [0, d/2) and [d/2, d) interleaved."""
    d = rows // n_head
    return [h * d + j * (d // 2) + i for h in range(n_head) for i in range(d // 2) for j in (0, 1)]


def _converted(name: str, w: torch.Tensor, heads: tuple[int, int] | None) -> torch.Tensor:
    """A q/k weight (or its ΔW) the way llama.cpp's LLAMA converter writes it."""
    if heads is None or not name.endswith(("q_proj.weight", "k_proj.weight")):
        return w
    n = heads[0] if name.endswith("q_proj.weight") else heads[1]
    return w[_rope_order(w.shape[0], n)]


def _peft_deltas(base: Path, adapter: Path) -> dict[str, torch.Tensor]:
    """peft's own ΔW (float64) per adapted parameter, stored layout."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float64)
        wrapped = PeftModel.from_pretrained(model, str(adapter))
    out = {}
    for name, module in wrapped.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            key = name.removeprefix("base_model.model.").replace(".base_layer", "")
            param = getattr(module, "parameter_name", "weight")
            out[f"{key}.{param}"] = module.get_delta_weight("default")
    return out


def _llama_view(
    name: str, d: torch.Tensor, model_type: str, heads: tuple[int, int] | None = None
) -> dict[str, torch.Tensor]:
    """ΔW as llama.cpp's tensors hold it: [out, in] per expert, gate_up split its way."""
    layer = name.split(".")[2]
    for proj, gguf_name in GGUF_ATTN.items():
        if name.endswith(f"{proj}_proj.weight"):
            return {f"blk.{layer}.{gguf_name}.weight": _converted(name, d, heads)}
    w = d.transpose(1, 2) if model_type == "gpt_oss" else d  # [E, out, in]
    if name.endswith("down_proj"):
        return {f"blk.{layer}.ffn_down_exps.weight": w}
    gate, up = (w[:, 0::2], w[:, 1::2]) if model_type == "gpt_oss" else w.chunk(2, dim=1)
    return {f"blk.{layer}.ffn_gate_exps.weight": gate, f"blk.{layer}.ffn_up_exps.weight": up}


def _read(path: Path) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: np.array(t.data, dtype=np.float64) for t in reader.tensors}
    keys = ("general.type", "general.architecture", "adapter.type", "adapter.lora.alpha")
    return tensors, {k: reader.fields[k].contents() for k in keys}


@pytest.mark.parametrize("variant", [*FAMILIES, "mixtral", "granitemoe-bias"])
def test_gguf_lora_equals_peft_per_expert(tmp_path: Path, variant: str) -> None:
    base = make_base(tmp_path, variant)
    fold = {"rank_pattern": {"down_proj": 3}, "alpha_pattern": {"down_proj": 8}}
    lora = fold if variant == "olmoe" else {}  # its own alpha/r: folded into B
    if variant.startswith("granitemoe"):
        lora["experts"] = GRANITE_EXPERTS
    adapter = make_adapter(base, tmp_path / "adapter", modules=ATTENTION, **lora)
    run_export(resolve_source(adapter, str(base)), "gguf", tmp_path / "out", ExportOptions())
    tensors, meta = _read(tmp_path / "out" / "adapter.gguf")
    assert meta == {"general.type": "adapter", "general.architecture": ARCH[variant],
                    "adapter.type": "lora", "adapter.lora.alpha": 4.0}  # fmt: skip
    expected: dict[str, torch.Tensor] = {}
    model_type = variant.split("-")[0]
    heads = (4, 2) if model_type in PERMUTED else None  # tiny.py: 4 heads, 2 kv heads
    for name, d in _peft_deltas(base, adapter).items():
        expected.update(_llama_view(name, d, model_type, heads))
    assert {f"{n}.lora_{x}" for n in expected for x in "ab"} == set(tensors)
    assert any("_exps" in n for n in expected)
    for name, want in expected.items():
        a, b = (torch.from_numpy(tensors[f"{name}.lora_{x}"]) for x in "ab")
        rank = b.shape[-1]  # llama.cpp: rank = b->ne[0], scale = alpha / rank
        got = (4.0 / rank) * (b @ a)
        assert got.shape == want.shape, name
        assert float((got - want).norm() / want.norm()) < 1e-6, name


def test_mixtral_lora_on_the_converted_base_is_the_converted_merge(tmp_path: Path) -> None:
    """llama.cpp adds the LoRA to the converter-permuted base: permute(W) + ΔW_gguf must be
    permute(W + ΔW) for q and k (GQA: k has fewer heads), in float64."""
    base = make_base(tmp_path, "mixtral")
    config = transformers.AutoConfig.from_pretrained(str(base))
    heads = (config.num_attention_heads, config.num_key_value_heads)
    assert heads[1] < heads[0]
    adapter = make_adapter(base, tmp_path / "adapter", modules=ATTENTION)
    run_export(resolve_source(adapter, str(base)), "gguf", tmp_path / "out", ExportOptions())
    tensors, _ = _read(tmp_path / "out" / "adapter.gguf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float64)
    weights = dict(model.named_parameters())
    checked = 0
    for name, d in _peft_deltas(base, adapter).items():
        if not name.endswith(("q_proj.weight", "k_proj.weight")):
            continue
        w = weights[name].detach()
        gguf_name = f"blk.{name.split('.')[2]}.attn_{name.split('.')[-2][0]}.weight"
        a, b = (torch.from_numpy(tensors[f"{gguf_name}.lora_{x}"]) for x in "ab")
        served = _converted(name, w, heads) + (4.0 / b.shape[-1]) * (b @ a)
        merged = _converted(name, w + d, heads)
        assert float((served - merged).norm() / d.norm()) < 1e-6, name
        unpermuted = _converted(name, w, heads) + d  # the 1:1 mapping of the other families
        assert float((unpermuted - merged).norm() / d.norm()) > 0.5, name
        checked += 1
    assert checked == 2 * config.num_hidden_layers


def test_deepseek_v3_lora_equals_peft_on_what_llamacpp_serves(tmp_path: Path) -> None:
    """DEEPSEEK2: o_proj and the routed stacks (halves) map 1:1 onto peft's ΔW."""
    base = make_base(tmp_path, "deepseek_v3")
    adapter = make_adapter(base, tmp_path / "adapter", modules=["o_proj"])
    run_export(resolve_source(adapter, str(base)), "gguf", tmp_path / "out", ExportOptions())
    tensors, meta = _read(tmp_path / "out" / "adapter.gguf")
    assert meta["general.architecture"] == "deepseek2"
    expected: dict[str, torch.Tensor] = {}
    for name, d in _peft_deltas(base, adapter).items():
        expected.update(_llama_view(name, d, "deepseek_v3"))
    assert {f"{n}.lora_{x}" for n in expected for x in "ab"} == set(tensors)
    assert {n.split(".")[2] for n in expected} == {
        "attn_output", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}  # fmt: skip
    for name, want in expected.items():
        a, b = (torch.from_numpy(tensors[f"{name}.lora_{x}"]) for x in "ab")
        got = (4.0 / b.shape[-1]) * (b @ a)
        assert float((got - want).norm() / want.norm()) < 1e-6, name


@pytest.mark.parametrize("module", ["q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"])
def test_deepseek_v3_mla_lora_llamacpp_would_drop_is_refused(tmp_path: Path, module: str) -> None:
    """llama.cpp loads a LoRA on MLA's q / kv projections and ignores it (plain matmuls), and
    splits kv_b_proj per head: refused with the way out, nothing written."""
    base = make_base(tmp_path, "deepseek_v3")
    adapter = make_adapter(base, tmp_path / "adapter", modules=["o_proj", module])
    with pytest.raises(ExportError, match=f"no LoRA to {module} in DEEPSEEK2") as err:
        run_export(resolve_source(adapter, str(base)), "gguf", tmp_path / "out", ExportOptions())
    assert f"without {module}" in err.value.fix and not (tmp_path / "out").exists()


def test_unmapped_family_is_refused_with_the_way_out(tmp_path: Path) -> None:
    base = make_base(tmp_path, "deepseek_v2-lite-like")
    adapter = make_adapter(base, tmp_path / "adapter")
    with pytest.raises(ExportError, match="no GGUF tensor mapping for 'deepseek_v2'") as err:
        run_export(resolve_source(adapter, str(base)), "gguf", tmp_path / "out", ExportOptions())
    assert "--format merged" in err.value.fix and not (tmp_path / "out").exists()


def test_a_venv_without_a_llamacpp_binding_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner in a python with neither llama-cpp-py-sync nor llama-cpp-python: the
    check is unavailable with the package to install, not a traceback."""
    monkeypatch.setenv("MOETUNE_LLAMACPP_PYTHON", sys.executable)  # moetune's own: no binding
    with pytest.raises(ConsumerUnavailable, match=r"no llama\.cpp binding here: pip install"):
        run_llamacpp(tmp_path / "base.gguf", None, [[1, 2]], [], 0)
