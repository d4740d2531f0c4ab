"""DPO and GRPO on quantised expert stacks (model.experts_dtype int8 / nf4, moetune's
engine): every target adapted, router frozen, the stacks really quantised, and the
reference policy – the adapter disabled – is the quantised base itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moetune.train.methods import reference_of
from test_train_helpers import run_config, save_tiny_model, train_capturing, write_jsonl
from test_train_methods import GRPO, preference_rows, prompt_rows

# a length reward: sampled lengths differ, so the group has advantages to learn from even on
# a random base (exact match is 0 for every sample there, and nothing would move)
GRPO_LENGTH = {**GRPO, "beta": 0.04, "rewards": [{"name": "length", "target_chars": 3}]}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("methods-quant")
    model = save_tiny_model(root / "qwen")
    return root, model


@pytest.mark.parametrize(
    ("method", "experts_dtype", "extra"),
    [("dpo", "int8", {}), ("grpo", "nf4", {"batch_size": 8, "grpo": GRPO_LENGTH})],
)
def test_preference_and_rl_train_quantised_experts(files, method, experts_dtype, extra):
    root, model = files
    rows = preference_rows(16) if method == "dpo" else prompt_rows(16)
    data = write_jsonl(root / f"{method}.jsonl", rows)
    cfg = run_config(model, data, root / method, method=method, max_steps=2, **extra)
    cfg.model.experts_dtype = experts_dtype  # type: ignore[assignment]
    result, trainer = train_capturing(cfg)
    assert (result.method, result.steps, result.coverage) == (method, 2, 1.0)
    assert result.router_changed is False
    quant = json.loads((Path(result.run_dir) / "quant.json").read_text())
    assert quant and experts_dtype in json.dumps(quant)  # the stacks really were quantised
    assert reference_of(trainer) == "adapter disabled"
    peft_model = trainer.model.eval()
    ids = torch.tensor([[10, 11, 12, 41, 13]])
    with torch.no_grad():
        tuned = peft_model(input_ids=ids).logits
        with peft_model.disable_adapter():
            ref = peft_model(input_ids=ids).logits
    # the expert LoRA moved the policy away from its reference (the quantised base)
    assert float((tuned - ref).norm() / ref.norm()) > 1e-6


def test_grpo_replays_the_rollouts_routing_on_quantised_experts_with_the_adapter_live(files):
    """Replay acts on the router's output, so int8 stacks route as the rollout did; the length
    reward moves the adapter, so the live check can tell the policy from the base."""
    root, model = files
    data = write_jsonl(root / "replay.jsonl", prompt_rows(16))
    grpo = {**GRPO_LENGTH, "routing_replay": "replay"}
    cfg = run_config(model, data, root / "replay", method="grpo", max_steps=4, batch_size=8,
                     grpo=grpo)  # fmt: skip
    cfg.model.experts_dtype = "int8"
    result, _ = train_capturing(cfg)
    run = Path(result.run_dir)
    shift = json.loads((run / "summary.json").read_text())["routing_shift"]
    compared = sum(x["tokens"] for line in (run / "routing_shift.jsonl").read_text().splitlines()
                   for x in json.loads(line)["layers"])  # fmt: skip
    assert shift["routing_replay"] == "replay" and shift["replayed_tokens"] >= compared > 0
    assert result.router_changed is False and "int8" in (run / "quant.json").read_text()
    live = shift["adapter_live"]
    assert live["verdict"] == "live" and live["rollout_vs_policy"] < live["rollout_vs_base"]
