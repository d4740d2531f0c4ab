"""A stored base's ignore list planned at real widths: a Kimi-K2-sized INT4 config whose
compressed-tensors `ignore` keeps attention, the shared experts and layer 0's dense MLP in
bf16 (as Kimi-K2-Thinking publishes) is planned with those Linears in bf16 – 12.3 GiB that
were planned as INT4 before the list was read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetune.config import parse_config
from moetune.model import load_spec
from moetune.model.sources import resolve_config
from moetune.plan.analytic import frozen_bytes
from moetune.plan.step import Step
from moetune.units import GiB

INT4 = {"quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
            "group_size": 32}}}}  # fmt: skip
ATTENTION = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _kimi_like(tmp_path: Path, ignore: list[str], layers: int) -> str:
    _, raw = resolve_config("moonshotai/Kimi-K2-Instruct")
    raw.pop("_moetune")
    raw["num_hidden_layers"] = layers  # Kimi-K2's widths; fewer layers for the fast tier
    raw["quantization_config"] = {**INT4, "ignore": ignore}
    tmp_path.mkdir()
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


def _thinking_ignore(layers: int) -> list[str]:
    """Kimi-K2-Thinking's list: every attention, shared-expert and dense Linear by name."""
    names = [f"model.layers.{i}.self_attn.{p}" for i in range(layers) for p in ATTENTION]
    names += [f"model.layers.{i}.mlp.shared_experts.{p}" for i in range(1, layers) for p in MLP]
    return ["lm_head", *names, *(f"model.layers.0.mlp.{p}" for p in MLP)]


@pytest.mark.parametrize("layers", [3, pytest.param(61, marks=pytest.mark.slow)])
def test_kimi_ignore_list_planned_in_bf16(tmp_path: Path, layers: int) -> None:
    listed = load_spec(_kimi_like(tmp_path / "a", _thinking_ignore(layers), layers))
    unlisted = load_spec(_kimi_like(tmp_path / "b", ["lm_head"], layers))
    cfg = parse_config({"model": {"id": "x"}, "lora": {"engine": "moetune"}})
    kept, stored = Step.from_config(cfg, listed), Step.from_config(cfg, unlisted)
    assert kept.stored_experts == stored.stored_experts == "int4"
    assert kept.stored_linear_params == 0  # every non-expert Linear listed: bf16
    c = unlisted.components
    assert stored.stored_linear_params == c.attention + c.dense_mlp + c.shared_experts
    gap = frozen_bytes(listed, kept) - frozen_bytes(unlisted, stored)
    assert gap == stored.stored_linear_params * (2 - stored.stored_linear_bytes)
    if layers == 61:  # the full size: what the plan undercounted before the list was read
        assert round(gap / GiB, 1) == 12.3
