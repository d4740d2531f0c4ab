"""Published quantised checkpoints planned beside their file sizes (docs/plan.md's table).

Each bundled entry carries its repo's config.json and quantisation as published, and the size
its files were reported at (`_moetune.published_bytes`, the source beside it). The plan's
frozen (weight) bytes must come within a stated tolerance of that size; each tolerance is what
the files hold beyond the weights the plan counts, plus the rounding of the reported size."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from moetune.config import parse_config
from moetune.engine.stored.formats import stored_format
from moetune.model import catalog_meta, load_spec
from moetune.model.sources import resolve_config
from moetune.plan.analytic import frozen_bytes
from moetune.plan.devices.expert_parallel import expert_weight_bytes
from moetune.plan.step import Step
from moetune.units import GiB

PLAN_MD = Path(__file__).resolve().parent.parent / "docs" / "plan.md"

# model id -> (published bytes, relative tolerance). Why each tolerance:
PUBLISHED = {
    # model.safetensors.index.json's total_size. The file also holds the MTP module (layer 61:
    # one more MoE layer in block FP8 with its own bf16 embedding and head copies, 14 B of the
    # 685 B parameters) that training leaves out: the plan is 2.2 % under, never over.
    "deepseek-ai/DeepSeek-V3": (688_586_727_753, 0.03),
    # Reported as 594 GB (rounded to 1 GB: ±0.1 %); no MTP layer (num_nextn_predict_layers 0),
    # beyond the weights only `weight_shape` int32 pairs.
    "moonshotai/Kimi-K2-Thinking": (594_000_000_000, 0.01),
    # "16G" from du -h of a snapshot (rounded up to a whole GiB: up to 6 % over the files);
    # g_idx (an int32 per input column of each Linear, 0.12 GB: 0.7 %) is the one tensor the
    # plan does not count (qzeros and scales it does).
    "Qwen/Qwen3-30B-A3B-GPTQ-Int4": (16 * GiB, 0.06),
    # "134 GB" (rounded: ±0.4 %); input_scale / k_scale / v_scale scalars are bytes.
    "nvidia/Qwen3-235B-A22B-NVFP4": (134_000_000_000, 0.01),
}
FP8_DYNAMIC = "RedHatAI/Qwen3-30B-A3B-FP8-dynamic"  # no published size found: see the last test
QWEN_FP8 = "Qwen/Qwen3-235B-A22B-FP8"  # Qwen's own block FP8: see its test below
BUNDLED = {*PUBLISHED, FP8_DYNAMIC, QWEN_FP8}


def _frozen(model_id: str) -> float:
    spec = load_spec(model_id)
    step = Step.from_config(parse_config({"model": {"id": model_id}}), spec)
    return frozen_bytes(spec, step)


@pytest.fixture(scope="module")
def frozen() -> dict[str, float]:
    return {model_id: _frozen(model_id) for model_id in PUBLISHED}


@pytest.mark.parametrize("model_id", sorted(PUBLISHED))
def test_planned_weights_are_the_published_files(model_id: str, frozen: dict[str, float]) -> None:
    published, tolerance = PUBLISHED[model_id]
    assert catalog_meta(model_id)["published_bytes"] == published  # one figure, one source
    assert abs(frozen[model_id] / published - 1) <= tolerance


def test_deepseek_gap_is_the_mtp_module(tmp_path: Path, frozen: dict[str, float]) -> None:
    """What the file holds beyond the plan is DeepSeek's MTP module (layer 61), which training
    leaves out: one more MoE layer as stored (planned by adding it), its own embedding and head
    in bf16, and eh_proj [h, 2h] (fp8 or bf16: 0.1 GB either way) – within 1 %."""
    model_id = "deepseek-ai/DeepSeek-V3"
    _, raw = resolve_config(model_id)
    raw.pop("_moetune")
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 62}))
    spec = load_spec(str(tmp_path))
    step = Step.from_config(parse_config({"model": {"id": model_id}}), spec)
    layer = frozen_bytes(spec, step) - frozen[model_id]
    h = raw["hidden_size"]
    head_and_embedding = 2 * raw["vocab_size"] * h * 2  # bf16, as the main model's
    expected = layer + head_and_embedding + 1.5 * 2 * h * h  # eh_proj at 1 or 2 bytes
    gap = PUBLISHED[model_id][0] - frozen[model_id]
    assert abs(gap / expected - 1) < 0.01


def _table() -> dict[str, str]:
    """docs/plan.md's table: model id -> its frozen GiB cell."""
    rows = re.findall(r"^\| `([^`]+)` \|[^|]*\|[^|]*\| ([\d.]+) GiB \|", PLAN_MD.read_text(), re.M)
    return dict(rows)


@pytest.mark.parametrize("model_id", sorted(PUBLISHED))
def test_docs_table_quotes_the_plan(model_id: str, frozen: dict[str, float]) -> None:
    assert _table()[model_id] == f"{frozen[model_id] / GiB:.1f}"


def test_compressed_tensors_fp8_is_planned_at_a_byte() -> None:
    """Qwen3-30B-A3B-FP8-dynamic (per-channel FP8, compressed-tensors float-quantized) is read
    as stored: its quantised Linears plan at ~1 byte a parameter, well under its bf16 size, and
    the docs table quotes the plan."""
    spec = load_spec(FP8_DYNAMIC)
    assert stored_format(spec.quant_config) is not None  # read, not refused
    planned = _frozen(spec.name)
    assert planned < 0.55 * spec.total_params * 2  # well under the bf16 size
    assert _table()[FP8_DYNAMIC] == f"{planned / GiB:.1f}"


def test_qwens_block_fp8_release_plans_its_experts_as_stored() -> None:
    """Qwen3-235B-A22B-FP8 (Qwen's block FP8, 128 × 128) is the bf16 release's architecture
    with the experts read as stored: a byte a weight plus a float32 scale per 128 × 128 block
    – gate / up [1536, 4096] and down [4096, 1536] are 12 × 32 blocks each."""
    fp8, bf16 = load_spec(QWEN_FP8), load_spec("Qwen/Qwen3-235B-A22B")
    assert fp8.total_params == bf16.total_params and fp8.num_experts == 128
    assert stored_format(fp8.quant_config) is not None  # read, not refused
    run = parse_config({"model": {"id": QWEN_FP8}})
    per_expert = 3 * 1536 * 4096 + 3 * (12 * 32) * 4  # fp8 weights + fp32 block scales
    assert expert_weight_bytes(fp8, run) == 94 * 128 * per_expert
    assert _frozen(QWEN_FP8) < 0.51 * _frozen(bf16.name)
