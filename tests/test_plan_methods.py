"""The planner's train.method terms: DPO's chosen + rejected batch with no reference copy,
GRPO's trained prompt + completion step and its rollout KV cache."""

from __future__ import annotations

from typing import Any

import pytest

from moetune.config import parse_config
from moetune.model import load_spec
from moetune.model.spec import ModelSpec
from moetune.plan.fit import analytic
from moetune.plan.methods import kv_cache_bytes, method_terms
from moetune.plan.planner import make_plan


@pytest.fixture(scope="module")
def qwen() -> ModelSpec:
    return load_spec("Qwen/Qwen3-30B-A3B")


def cfg(**train: Any):
    return parse_config({"lora": {"rank": 8}, "train": {"seq_len": 1024, **train}})


def test_dpo_trains_chosen_and_rejected_on_the_same_weights(qwen):
    sft, dpo = analytic(qwen, cfg()), analytic(qwen, cfg(method="dpo"))
    assert method_terms(cfg(method="dpo", batch_size=3), qwen).batch_size == 6
    # the reference is the adapter disabled: not one byte of weights more
    assert dpo.components["frozen_weights"] == sft.components["frozen_weights"]
    assert dpo.components["trainable_weights"] == sft.components["trainable_weights"]
    assert dpo.components["activations"] > 1.5 * sft.components["activations"]


def test_grpo_kv_cache_is_layers_heads_tokens_sequences(qwen):
    c = cfg(method="grpo", batch_size=8, grad_accum=2, grpo={"max_completion_length": 3072})
    terms = method_terms(c, qwen)
    # K and V × 48 layers × 4 KV heads × 128 dims × 2 bytes, per token
    assert kv_cache_bytes(qwen, 1, 1, 2) == 2 * 48 * 4 * 128 * 2
    assert terms.kv_cache_bytes == 16 * (1024 + 3072) * 2 * 48 * 4 * 128 * 2
    assert (terms.seq_len, terms.batch_size) == (4096, 8)
    assert terms.rollout_logits_bytes == 16 * qwen.vocab_size * 4


def test_grpo_rollout_is_the_peak_when_the_generation_batch_dominates(qwen):
    c = cfg(method="grpo", batch_size=1, grad_accum=64, grpo={"max_completion_length": 8192})
    est = analytic(qwen, c)
    terms = method_terms(c, qwen)
    static = sum(est.components[k] for k in ("frozen_weights", "trainable_weights"))
    assert est.peak_phase == "rollout"
    assert est.peak_bytes == (
        static + est.components["optimizer_state"] + terms.kv_cache_bytes
        + terms.rollout_logits_bytes
    )  # fmt: skip
    plan = make_plan(qwen, c, cards=["H100-80GB"], estimator="analytic")
    assert plan.peak_phase == "rollout" and any("rollout KV cache" in n for n in plan.notes)


def test_sft_plan_is_unchanged_by_the_method_terms(qwen):
    c = cfg()
    terms = method_terms(c, qwen)
    assert (terms.seq_len, terms.batch_size, terms.rollout_bytes) == (1024, 1, 0)
    assert analytic(qwen, c).peak_phase != "rollout"


def test_grpo_counts_the_routing_record_and_the_replayed_indices(qwen):
    """Qwen3-30B-A3B: 48 MoE layers, top-8; 8 rows of 1024 + 16 tokens (int64 indices)."""
    assert (len(qwen.moe_layers), qwen.top_k) == (48, 8)
    off = cfg(method="grpo", batch_size=8)
    on = cfg(method="grpo", batch_size=8, grpo={"routing_replay": "replay"})
    tokens = 8 * 1040
    replay = tokens * 48 * 8 * 8
    assert method_terms(on, qwen).replay_bytes == replay == 25_559_040
    assert method_terms(off, qwen).replay_bytes == 0
    kept = 8 * tokens  # the last 8 rollouts: tokens + 8 indices per MoE layer each
    assert method_terms(off, qwen).routing_record_bytes == kept * 8 + kept * 48 * 8 * 8
    plain, replayed = analytic(qwen, off), analytic(qwen, on)
    assert replayed.peak_bytes == plain.peak_bytes + replay
    assert replayed.components["routing_replay"] == replay
    notes = make_plan(qwen, on, cards=["H100-80GB"]).notes
    line = next(n for n in notes if n.startswith("grpo routing record"))
    assert "8 expert indices per token × 48 MoE layers" in line and "195.5 MiB" in line
    assert "routing replay holds 24.4 MiB on the device" in line
