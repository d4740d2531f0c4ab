"""dbrx's experts under peft LoRA (engine/forwards_dbrx.py, the override for "dbrx").

Tiny fp32 dbrx (4 experts, top-2) with LoRA on its 2-D expert stacks `w1, v1, w2`. The
reference is transformers' own, untouched DbrxExperts forward in float64 on weights with
ΔW = s·B·A merged in explicitly; B is random non-zero where it matters (peft initialises
B = 0, which would hide an error in how B is read).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from peft import PeftModel, get_peft_model
from peft.tuners.lora.layer import ParamWrapper
from torch.func import functional_call

from moetune.config import LoraArgs
from moetune.engine.forwards import ENGINE_OVERRIDES, apply_overrides
from moetune.model import spec_from_config, to_hf_config
from moetune.model.census import shrunk_config
from moetune.model.derive import causal_lm_class
from moetune.plan.trace.fake_step import trace_step
from moetune.recipe.targets import build_peft_config

pytestmark = pytest.mark.filterwarnings("ignore")
STACKS = ("w1", "v1", "w2")
EXPERTS, TOP_K, INTERMEDIATE = 4, 2, 48


def _spec() -> Any:
    values = shrunk_config("dbrx")
    values["ffn_config"]["moe_top_k"] = TOP_K
    return spec_from_config(values, "dbrx")


def _models(targets: tuple[str, ...] = ("experts",)) -> tuple[Any, Any, Any]:
    """(peft model with the override, its float64 base copy untouched, the peft config)."""
    spec = _spec()
    config = to_hf_config(spec)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = causal_lm_class(config)._from_config(config, dtype=torch.float32).eval()
    reference = copy.deepcopy(base).double()
    peft_config = build_peft_config(spec, LoraArgs(rank=4, targets=list(targets)))
    model = get_peft_model(base, copy.deepcopy(peft_config))
    assert apply_overrides(model) == spec.num_layers
    return model, reference, peft_config


def _wrappers(model: Any) -> dict[str, ParamWrapper]:
    return {
        f"{name.rsplit('.mlp', 1)[0]}.mlp.{m.parameter_name}": m
        for name, m in model.named_modules()
        if isinstance(m, ParamWrapper)
    }


def _randomise_b(model: Any) -> None:
    torch.manual_seed(1)
    with torch.no_grad():
        for wrapper in _wrappers(model).values():
            wrapper.lora_B["default"].weight.normal_(0.0, 0.2)


def _batch() -> dict[str, torch.Tensor]:
    torch.manual_seed(2)
    ids = torch.randint(0, 100, (2, 12))
    return {"input_ids": ids, "labels": ids}


def _reference_loss(reference: Any, model: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """float64 loss of transformers' own forward with W + s·B·A merged, and the factors it
    differentiates: {stack path: (A, B)} as float64 leaves."""
    factors, merged = {}, {}
    for path, wrapper in _wrappers(model).items():
        a = wrapper.lora_A["default"].weight.detach().double().requires_grad_()
        b = wrapper.lora_B["default"].weight.detach().double().requires_grad_()
        weight = reference.get_parameter(path.removeprefix("base_model.model."))
        merged[path.removeprefix("base_model.model.")] = weight + wrapper.scaling["default"] * b @ a
        factors[path] = (a, b)
    loss = functional_call(reference, merged, args=(), kwargs=_batch()).loss
    return loss, factors


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.double() - y).norm() / y.norm())


def test_plain_peft_cannot_reach_dbrxs_experts() -> None:
    """Why the override exists: transformers reads `mlp.v1` outside peft's wrapper. When this
    stops failing, check whether peft now applies ΔW there and the override can go."""
    model, _, _ = _models()
    for module in model.modules():  # undo the override: transformers' own forward
        if type(module).__name__ == "LoraDbrxExperts":
            module.__class__ = type(module).__mro__[1]
    with pytest.raises(AttributeError, match="no attribute 'v1'"):
        model(**_batch())


def test_loss_and_lora_gradients_equal_a_float64_merged_reference() -> None:
    model, reference, _ = _models()
    _randomise_b(model)
    out = model(**_batch())
    out.loss.backward()
    ref_loss, factors = _reference_loss(reference, model)
    ref_loss.backward()
    assert abs(out.loss.item() - ref_loss.item()) / ref_loss.item() < 1e-6
    assert out.loss.item() != pytest.approx(reference(**_batch()).loss.item(), rel=1e-3)  # ΔW≠0
    wrappers = _wrappers(model)
    assert len(wrappers) == 3 * _spec().num_layers
    for path, (a, b) in factors.items():
        lora = wrappers[path]
        assert a.grad is not None and b.grad is not None
        assert _rel(lora.lora_A["default"].weight.grad, a.grad) < 1e-5, path
        assert _rel(lora.lora_B["default"].weight.grad, b.grad) < 1e-5, path


def _routed_experts(model: Any) -> list[set[int]]:
    seen: list[set[int]] = []

    def hook(module: Any, args: Any, logits: torch.Tensor) -> None:
        seen.append(set(logits.topk(TOP_K, dim=-1).indices.reshape(-1).tolist()))

    handles = [m.register_forward_hook(hook) for n, m in model.named_modules()
               if n.endswith("ffn.router")]  # fmt: skip
    model(**_batch())
    for handle in handles:
        handle.remove()
    return seen


def test_every_routed_experts_lora_gets_gradients_after_a_step() -> None:
    """peft's init (B = 0): the first backward reaches B only; after one optimizer step
    every expert's rows of B and the shared A have non-zero gradients."""
    model, _, _ = _models()
    assert all(len(s) == EXPERTS for s in _routed_experts(model))  # every expert has tokens
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    optimizer = torch.optim.SGD(lora, lr=0.1)
    for step in range(2):
        optimizer.zero_grad()
        model(**_batch()).loss.backward()
        if step == 0:
            a_grads = [w.lora_A["default"].weight.grad for w in _wrappers(model).values()]
            assert all(g is not None and g.abs().max() == 0 for g in a_grads)
            optimizer.step()
    for path, wrapper in _wrappers(model).items():
        a, b = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight
        assert a.grad is not None and b.grad is not None
        assert a.grad.norm() > 0, path
        per_expert = b.grad.view(EXPERTS, INTERMEDIATE, -1).flatten(1).norm(dim=1)
        assert (per_expert > 0).all(), (path, per_expert.tolist())


def test_the_adapter_is_peft_format_and_merges_to_the_same_logits(tmp_path) -> None:
    """peft's own merge (its get_delta_weight layout) and a plain reload agree with the override."""
    model, reference, peft_config = _models()
    _randomise_b(model)
    batch = _batch()
    with torch.no_grad():
        logits = model(**batch).logits
        model.save_pretrained(tmp_path)
        base = copy.deepcopy(reference).float()
        reloaded = PeftModel.from_pretrained(base, str(tmp_path))
        apply_overrides(reloaded)
        again = reloaded(**batch).logits
        with model.disable_adapter():  # peft's switch reaches the override: the base again
            disabled = model(**batch).logits
        merged = model.merge_and_unload()(**batch).logits
    assert torch.equal(again, logits)
    assert _rel(merged, logits.double()) < 1e-5
    plain = reference(**batch).logits.detach()
    assert _rel(disabled, plain) < 1e-5 < _rel(logits, plain)
    assert peft_config.target_parameters == [f"ffn.experts.mlp.{s}" for s in STACKS]


def test_override_is_registered_and_idempotent() -> None:
    model, _, _ = _models()
    classes = {type(m) for m in model.modules() if type(m).__name__.endswith("DbrxExperts")}
    assert "dbrx" in ENGINE_OVERRIDES
    assert apply_overrides(model) == _spec().num_layers
    assert {type(m) for m in model.modules() if type(m).__name__.endswith("DbrxExperts")} == classes
    assert [c.__name__ for c in classes] == ["LoraDbrxExperts"]


def test_the_planner_traces_dbrxs_lora_step_on_fake_tensors() -> None:
    """transformers' expert loop calls nonzero (no fake kernel); the override's grouped path
    traces, and a fake step allocates what the real CPU step does."""
    spec = _spec()
    peft_config = build_peft_config(spec, LoraArgs(rank=4, targets=["attention", "experts"]))
    config = to_hf_config(spec)
    step = {"seq_len": 16, "loss": "full", "gradient_checkpointing": False}
    traces = [trace_step(config, peft_config, **step, fake=fake) for fake in (True, False)]
    assert traces[0].peak_bytes == traces[1].peak_bytes > 0
    assert traces[0].trainable_params == traces[1].trainable_params
