"""Routing replay (train.grpo.routing_replay: replay): every registered family's gate rule
gives a router's own weights back for its own choice; with replay the experts of the
training pass are the rollout's for every token the rollout fed, the router stays frozen,
and the LoRA gradients equal a reference forward with the same routing forced by hand."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moetune.model import load_spec
from moetune.model.tiny import tiny_config
from moetune.train.errors import TrainError
from moetune.train.grpo.replay import GATES, gate_of, replayed
from moetune.train.grpo.shift import ShiftRecorder
from test_train_helpers import save_tiny_model

# Routers of families moetune's tiny set lacks, built here so every gate rule is checked
_SMALL = {
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "head_dim": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "max_position_embeddings": 64,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 8,
}
EXTRA = {
    "qwen3_next": {**_SMALL, "model_type": "qwen3_next", "num_experts": 4,
                   "shared_expert_intermediate_size": 8, "linear_num_key_heads": 2,
                   "linear_num_value_heads": 2, "linear_key_head_dim": 4,
                   "linear_value_head_dim": 4,
                   "layer_types": ["linear_attention", "full_attention"]},
    "dots1": {**_SMALL, "model_type": "dots1", "n_routed_experts": 4, "n_shared_experts": 1,
              "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1},
}  # fmt: skip
FAMILIES = ["qwen2_moe-shared-dense0", "qwen3_moe-dense0", "olmoe", "mixtral",
            "deepseek_v2-lite-like", "deepseek_v3", "glm4_moe-qknorm", *EXTRA]  # fmt: skip


def family_config(variant: str) -> dict[str, Any]:
    """A tiny config.json dict: moetune's tiny variant, or one of EXTRA."""
    return dict(EXTRA[variant]) if variant in EXTRA else tiny_config(variant)


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ in GATES.names()]


@pytest.mark.parametrize("variant", FAMILIES)
def test_each_gate_rule_gives_the_router_its_own_weights_back(variant):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**family_config(variant)))
    routers = _routers(model)
    assert routers, f"{variant}: no registered router"
    for router in routers:
        if hasattr(router, "e_score_correction_bias"):  # a bias that moves the choice only
            router.e_score_correction_bias.normal_()
        router.weight.data.normal_()
        out = router(torch.randn(7, model.config.hidden_size))
        again = replayed(router, out, out[2])
        torch.testing.assert_close(again[1].float(), out[1].float(), rtol=1e-5, atol=1e-6)
        assert torch.equal(again[2], out[2])


def test_a_router_without_a_gate_rule_is_refused_naming_the_fix():
    with pytest.raises(TrainError) as err:
        gate_of(torch.nn.Linear(2, 2))
    assert "no gate rule for router Linear" in err.value.cause
    assert "routing_replay: off" in err.value.fix


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("replay") / "qwen")


def _policy(path: Any) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    lora = LoraConfig(r=2, target_modules=["q_proj", "o_proj"], init_lora_weights=False)
    return get_peft_model(base, lora)


def _experts_seen(model: torch.nn.Module) -> tuple[dict[int, list[torch.Tensor]], list[Any]]:
    """Per MoE layer, the top-k index tensor each experts call received."""
    seen: dict[int, list[torch.Tensor]] = {}
    handles = []
    for i, layer in enumerate(model.get_base_model().model.layers):

        def grab(module: Any, args: Any, i: int = i) -> None:
            seen.setdefault(i, []).append(args[1].detach().clone())

        handles.append(layer.mlp.experts.register_forward_pre_hook(grab))
    return seen, handles


PROMPT = torch.tensor([[15, 4, 22, 23, 40], [15, 4, 5, 6, 40]])


def _rollout_then_train(
    path: Any, replay: bool, checkpointing: bool = False
) -> tuple[Any, dict, dict, torch.Tensor]:
    """Generate, negate the routers (the policy moved), train forward + backward."""
    model = _policy(path)
    if checkpointing:  # backward re-runs the routers: they must replay the same choice
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ShiftRecorder(model, load_spec(str(path)), replay=replay)  # its hooks stay on the model
    model.eval()
    seen, handles = _experts_seen(model)
    with torch.no_grad():
        seqs = model.generate(input_ids=PROMPT, max_new_tokens=4, min_new_tokens=4,
                              do_sample=False)  # fmt: skip
    rollout = {i: torch.cat([c.reshape(2, -1, c.shape[-1]) for c in cs], 1)
               for i, cs in seen.items()}  # fmt: skip
    seen.clear()
    with torch.no_grad():
        for layer in model.get_base_model().model.layers:
            layer.mlp.gate.weight.mul_(-1)
    model.train()
    out = model(input_ids=seqs, attention_mask=torch.ones_like(seqs))
    out.logits.logsumexp(-1).sum().backward()
    for handle in handles:
        handle.remove()
    train = {i: cs[0].reshape(2, -1, cs[0].shape[-1]) for i, cs in seen.items()}
    return model, rollout, train, seqs


def _agreement(rollout: dict, train: dict) -> float:
    same = [
        (r.sort(-1).values == t[:, : r.shape[1]].sort(-1).values).all(-1).float().mean()
        for r, t in ((rollout[i], train[i]) for i in rollout)
    ]
    return float(sum(same) / len(same))


def test_replay_routes_every_fed_token_to_the_rollouts_experts(qwen):
    _, rollout, moved, _ = _rollout_then_train(qwen, replay=False)
    assert _agreement(rollout, moved) < 0.6  # negated router: most top-2 sets flip
    _, rollout, train, _ = _rollout_then_train(qwen, replay=True)
    assert _agreement(rollout, train) == 1.0


@pytest.mark.parametrize("checkpointing", [False, True])
def test_replay_keeps_the_router_frozen_and_grads_match_a_forced_reference(qwen, checkpointing):
    model, rollout, train, seqs = _rollout_then_train(qwen, True, checkpointing)
    assert all(p.grad is None for n, p in model.named_parameters() if "mlp.gate" in n)
    reference = _policy(qwen)
    reference.load_state_dict(model.state_dict())
    for i, layer in enumerate(reference.get_base_model().model.layers):
        last = train[i][:, -1:]  # never fed in the rollout: the router's own choice
        forced = torch.cat([rollout[i], last], 1).reshape(-1, 2)
        layer.mlp.gate.forward = _forced_router(layer.mlp.gate, forced)
    reference.train()
    out = reference(input_ids=seqs, attention_mask=torch.ones_like(seqs))
    out.logits.logsumexp(-1).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "lora_" in n}
    ref = {n: p.grad for n, p in reference.named_parameters() if "lora_" in n}
    assert grads and grads.keys() == ref.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref[name], rtol=1e-4, atol=1e-6)  # fp32, any CPU


def _forced_router(router: Any, forced: torch.Tensor) -> Any:
    """Qwen3-MoE's router with the choice forced, written out by hand (fp32: the grouped-mm
    experts take no float64)."""

    def forward(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = torch.nn.functional.linear(hidden.reshape(-1, router.hidden_dim), router.weight)
        picked = logits.softmax(-1).gather(1, forced)
        if router.norm_topk_prob:
            picked = picked / picked.sum(-1, keepdim=True)
        return logits, picked, forced

    return forward
