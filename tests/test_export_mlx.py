"""peft <-> mlx-lm adapters, HF base -> mlx-lm, fused mlx -> transformers, and served ==
trained: on tiny random qwen3_moe (with a dense first layer), olmoe and mixtral, float32."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'moetune[mlx]')")

import torch
from safetensors.torch import load_file, save_file

from moetune.config import LoraArgs
from moetune.export.mlx import (
    MlxExportError,
    _relative,
    export_mlx,
    fused_to_hf,
    hf_to_mlx,
    mlx_logits,
    mlx_to_peft,
    peft_logits,
    peft_to_mlx,
    served_matches_trained,
)
from moetune.model import spec_from_config
from moetune.model.tiny import tiny_config

FAMILIES = {  # variant -> LoRA targets (qwen3_moe-dense0's layer 0 is a dense MLP)
    "qwen3_moe-dense0": ["attention", "experts", "dense"],
    "olmoe": ["attention", "experts"],
    "mixtral": ["attention", "experts"],
}
TOKENS = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 5, 6, 7, 30, 31, 32, 33]]


def _base(root: Path, variant: str) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from moetune.demo.tokenizer import build_tokenizer

    torch.manual_seed(0)
    config = AutoConfig.for_model(**tiny_config(variant))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(root / "base")
    build_tokenizer().save_pretrained(root / "base")
    return root / "base"


def _peft(root: Path, base: Path, variant: str) -> Path:
    """moetune's recipe adapter with random A and B (a trained adapter's shape)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from moetune.recipe.targets import build_peft_config

    spec = spec_from_config(tiny_config(variant), variant)
    config = build_peft_config(spec, LoraArgs(rank=2, targets=FAMILIES[variant]))
    config.init_lora_weights = False
    torch.manual_seed(1)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), config)
    model.save_pretrained(root / "peft")
    return root / "peft"


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp(request.param)
    base = _base(root, request.param)
    return request.param, root, base, _peft(root, base, request.param)


def test_served_equals_trained(family) -> None:
    """The converted adapter in mlx-lm gives peft's logits in transformers."""
    _, _, base, adapter = family
    check = served_matches_trained(base, adapter, TOKENS)
    assert check["ok"] and check["relative_error"] < 1e-5, check
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(base)(torch.tensor(TOKENS)).logits
    moved = _relative(peft_logits(base, adapter, TOKENS), plain.detach().numpy())
    assert moved > 1e-3  # the adapter changes the output: the check is not vacuous


def test_peft_mlx_peft_round_trip_is_exact(family) -> None:
    _, root, base, adapter = family
    mlx = peft_to_mlx(adapter, root / "rt-mlx", str(base))
    back = mlx_to_peft(mlx, root / "rt-peft", str(base))
    original = load_file(str(adapter / "adapter_model.safetensors"))
    again = load_file(str(back / "adapter_model.safetensors"))
    assert set(again) == set(original)
    assert all(torch.equal(again[k], original[k]) for k in original)


def test_mlx_adapter_with_separate_gate_and_up_converts_exactly(family) -> None:
    """An mlx-lm adapter (gate and up with their own A, as mlx-lm trains them) becomes a
    rank-2r peft gate_up with the same logits, and converts back to the same tensors."""
    _, root, base, adapter = family
    mlx_dir = peft_to_mlx(adapter, root / "own-mlx", str(base))
    tensors = load_file(str(mlx_dir / "adapters.safetensors"))
    torch.manual_seed(2)
    tensors = {k: torch.randn_like(v) * 0.1 for k, v in tensors.items()}  # independent A's
    save_file(tensors, str(mlx_dir / "adapters.safetensors"), metadata={"format": "mlx"})
    peft_dir = mlx_to_peft(mlx_dir, root / "own-peft", str(base))
    mlx_base = hf_to_mlx(base, root / "own-base")
    served = mlx_logits(mlx_base, mlx_dir, TOKENS)
    assert _relative(peft_logits(base, peft_dir, TOKENS), served) < 1e-5
    again = load_file(
        str(peft_to_mlx(peft_dir, root / "own-mlx2", str(base)) / "adapters.safetensors")
    )
    assert set(again) == set(tensors) and all(torch.equal(again[k], tensors[k]) for k in tensors)


def test_hf_to_mlx_fills_the_fields_mlx_lm_needs(tmp_path: Path) -> None:
    """The demo base (transformers 5: num_local_experts, rope_parameters) loads in mlx-lm,
    in float32 on mlx's CPU backend."""
    import json

    from moetune.demo.base import SHIPPED_DIR

    out = hf_to_mlx(SHIPPED_DIR, tmp_path / "demo-mlx")
    config = json.loads((out / "config.json").read_text())
    assert config["num_experts"] == 8 and config["head_dim"] == 32
    assert config["rope_theta"] == 10000.0
    weights = load_file(str(out / "model.safetensors"))
    stacked = weights["model.layers.0.mlp.switch_mlp.gate_proj.weight"]
    assert stacked.shape == (8, 128, 128) and stacked.dtype == torch.float32
    assert mlx_logits(out, None, [[3, 4, 5]]).shape == (1, 3, 48)


def _fuse(mlx_base: Path, mlx_adapter: Path, out: Path) -> Path:
    """`mlx_lm.fuse --model … --adapter-path … --save-path …`, run in this process."""
    from unittest import mock

    from mlx_lm import fuse

    argv = ["mlx_lm.fuse", "--model", str(mlx_base), "--adapter-path", str(mlx_adapter)]
    with mock.patch.object(sys, "argv", [*argv, "--save-path", str(out)]):
        fuse.main()
    return out


def test_fused_mlx_model_back_in_transformers_layout(family) -> None:
    """mlx_lm.fuse output loads in transformers with random experts (the trap); converted
    by fused_to_hf it loads with every tensor and gives the merged adapter's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, root, base, adapter = family
    mlx_base = hf_to_mlx(base, root / "fuse-base")
    fused = _fuse(mlx_base, peft_to_mlx(adapter, root / "fuse-ad", str(base)), root / "fused")
    _, info = AutoModelForCausalLM.from_pretrained(fused, output_loading_info=True)
    assert any(".experts." in k for k in info["missing_keys"])  # silently random experts
    hf = fused_to_hf(fused, root / "fused-hf")
    model, info = AutoModelForCausalLM.from_pretrained(hf, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    with torch.no_grad():
        want = merged.merge_and_unload()(torch.tensor(TOKENS)).logits.numpy()
        got = model(torch.tensor(TOKENS)).logits.numpy()
    assert _relative(got, want) < 1e-5


def test_refusals(tmp_path: Path, family) -> None:
    _, _, base, adapter = family
    with pytest.raises(MlxExportError, match="already exists"):
        peft_to_mlx(adapter, adapter, str(base))
    with pytest.raises(MlxExportError, match="does not exist"):
        mlx_to_peft(tmp_path / "nothing", tmp_path / "out", str(base))
    assert not (tmp_path / "out").exists()


def test_export_format_writes_model_adapters_and_checks(family) -> None:
    _, root, base, adapter = family
    out = export_mlx(adapter, root / "export", str(base), tokens=TOKENS)
    assert out["check"]["ok"] and out["check"]["relative_error"] < 1e-5
    assert Path(out["model"], "config.json").is_file()
    assert Path(out["adapters"], "adapters.safetensors").is_file()
