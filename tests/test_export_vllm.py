"""`--format vllm`: the layout vLLM's MoE LoRA wrapper for the family reads, with the exact
options in README.md / vllm.json. 2-D families (qwen3_moe, olmoe) get per-expert keys whose
alpha/r · B@A equals peft's ΔW slices; 3-D families (gpt_oss) keep peft's adapter; families
whose expert LoRA vLLM ignores are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from export_fixtures import make_adapter, make_base
from moetune.export import ExportError, ExportOptions, resolve_source, run_export
from test_export_gguf import _peft_deltas

pytestmark = pytest.mark.filterwarnings("ignore")


def _export(
    tmp_path: Path, variant: str, layout: str = "auto", **lora: object
) -> tuple[Path, Path, Path]:
    base = make_base(tmp_path, variant)
    adapter = make_adapter(base, tmp_path / "adapter", **lora)
    opts = ExportOptions.model_validate({"extra": {"vllm_layout": layout}})
    run_export(resolve_source(adapter, str(base)), "vllm", tmp_path / "out", opts)
    return base, adapter, tmp_path / "out"


@pytest.mark.parametrize("variant", ["qwen3_moe-dense0", "olmoe"])
def test_2d_families_get_per_expert_keys_equal_to_peft(tmp_path: Path, variant: str) -> None:
    base, adapter, out = _export(tmp_path, variant, rank_pattern={"down_proj": 3})
    tensors = load_file(str(out / "adapter_model.safetensors"))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == config["lora_alpha"] == 3 and not config["target_parameters"]
    assert config["target_modules"] == ["down_proj", "gate_proj", "o_proj", "q_proj", "up_proj"]
    assert not any(".base_layer." in k or "experts.lora_" in k for k in tensors)
    checked = 0
    for name, d in _peft_deltas(base, adapter).items():
        if ".experts." not in name:
            continue
        stem, _, which = name.rpartition(".")
        halves = dict(zip(("gate_proj", "up_proj"), d.chunk(2, dim=1), strict=True))
        parts = halves if which == "gate_up_proj" else {"down_proj": d}
        for part, want in parts.items():
            for e in range(want.shape[0]):
                key = f"base_model.model.{stem}.{e}.{part}"
                a, b = (tensors[f"{key}.lora_{x}.weight"].double() for x in "AB")
                got = (config["lora_alpha"] / config["r"]) * (b @ a)
                assert float((got - want[e]).norm() / want[e].norm()) < 1e-6, key
                checked += 1
    assert checked == 4 * 3 * (2 if variant == "qwen3_moe-dense0" else 3)
    readme = (out / "README.md").read_text()
    assert "vllm serve" in readme and "--enable-lora" in readme and "--max-lora-rank 8" in readme
    assert "mixed-moe" not in readme and str(out) in readme


def test_3d_family_keeps_the_peft_adapter(tmp_path: Path) -> None:
    _, adapter, out = _export(tmp_path, "gpt_oss")
    mine = (out / "adapter_model.safetensors").read_bytes()
    assert mine == (adapter / "adapter_model.safetensors").read_bytes()
    options = json.loads((out / "vllm.json").read_text())
    assert options["layout"] == "fused" and "is_3d_lora_weight" not in options["lora_request"]


def test_fused_layout_on_a_2d_family_prints_both_flags(tmp_path: Path) -> None:
    _, _, out = _export(tmp_path, "qwen3_moe-dense0", layout="fused")
    options = json.loads((out / "vllm.json").read_text())
    assert "--enable-mixed-moe-lora-format" in options["engine_flags"]
    assert options["lora_request"]["is_3d_lora_weight"] is True
    assert '"is_3d_lora_weight": true' in (out / "README.md").read_text()


def test_family_whose_expert_lora_vllm_ignores_is_refused(tmp_path: Path) -> None:
    base = make_base(tmp_path, "olmoe")
    adapter = make_adapter(base, tmp_path / "adapter")
    fake = tmp_path / "nemotron"
    fake.mkdir()
    (fake / "config.json").write_text(json.dumps({"model_type": "nemotron_h"}))
    with pytest.raises(ExportError, match="vLLM ignores expert LoRA for nemotron_h") as err:
        run_export(resolve_source(adapter, str(fake)), "vllm", tmp_path / "out", ExportOptions())
    assert "--format merged" in err.value.fix
    assert not (tmp_path / "out").exists()
