"""The adapter-live check of GRPO rollouts: the rollout's log-probs of a sample must be the
policy's (adapter on), not the base's; a rollout that drops the adapter stops the run with
the fix, and a still-zero adapter leaves the check undecided until it moved."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from moetune.train.errors import TrainError
from moetune.train.grpo.adapter_live import LiveCheck
from test_train_helpers import save_tiny_model

PROMPT = torch.tensor([[15, 4, 22, 23, 40], [15, 4, 5, 6, 40]])
STATE = types.SimpleNamespace(global_step=1)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("live") / "qwen")


def _policy(path: Any, moved: bool) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(path)
    lora = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=not moved)
    return get_peft_model(base, lora)


def _step(model: Any, check: LiveCheck, drop_adapter: bool) -> None:
    """One GRPO-like step: sample (with or without the adapter), then the training pass."""
    model.eval()
    with torch.no_grad():
        if drop_adapter:  # an engine that ignores the LoRA
            with model.disable_adapter():
                seqs = model.generate(input_ids=PROMPT, max_new_tokens=5, min_new_tokens=5)
        else:
            seqs = model.generate(input_ids=PROMPT, max_new_tokens=5, min_new_tokens=5)
    model.train()
    model(input_ids=seqs, attention_mask=torch.ones_like(seqs), logits_to_keep=6)
    check.on_step_end(None, STATE, None)


def test_a_rollout_with_the_adapter_is_live(qwen):
    model = _policy(qwen, moved=True)
    check = LiveCheck(model)
    _step(model, check, drop_adapter=False)
    result = check.result
    assert result["verdict"] == "live" and result["tokens"] == 5
    assert result["rollout_vs_policy"] < 1e-4 < 1e-3 < result["policy_vs_base"]


def test_a_rollout_from_the_base_stops_the_run_with_the_fix(qwen):
    model = _policy(qwen, moved=True)
    check = LiveCheck(model)
    with pytest.raises(TrainError) as err:
        _step(model, check, drop_adapter=True)
    assert "the rollout samples from the base, not the policy" in err.value.cause
    assert "train.grpo.use_vllm: false" in err.value.fix
    assert check.result["rollout_vs_base"] < 1e-4


def test_a_zero_adapter_is_undecided_until_the_tries_run_out(qwen):
    model = _policy(qwen, moved=False)  # LoRA B = 0: policy == base
    check = LiveCheck(model, tries=2)
    for n in (1, 2):
        _step(model, check, drop_adapter=True)
        assert check.result["verdict"] == "undecided" and check.result["steps"] == n
    assert check.done
