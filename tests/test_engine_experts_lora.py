"""Split LoRA on fused experts (engine/experts_lora.py) against peft's stock ParamWrapper path.

Tiny fp32 models with random non-zero B (peft initialises B=0, which would hide any error
in how B is read). Families cover every experts layout the split path has to honour:
concatenated [E, out, in] (qwen3_moe, olmoe, mixtral, deepseek_v3), gpt_oss (interleaved
gate/up, transposed [E, in, out], biases, its own clamped gate) and nemotron_h (no gate:
up_proj + relu²).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora.layer import ParamWrapper
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from moetune.engine import (
    IMPLEMENTATION,
    EngineError,
    SplitParamWrapper,
    apply_split_lora,
    experts_lora,
    is_split,
    restore_peft_lora,
)
from moetune.model.tiny import tiny_config

RANK = 4
GATE_UP = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
NO_GATE = ["mixer.experts.up_proj", "mixer.experts.down_proj"]
# variant -> (is_concatenated, is_transposed, has_bias, has_gate) of its experts
FAMILIES: dict[str, tuple[bool, bool, bool, bool]] = {
    "qwen3_moe-dense0": (True, False, False, True),
    "olmoe": (True, False, False, True),
    "mixtral": (True, False, False, True),
    "deepseek_v3": (True, False, False, True),
    "gpt_oss": (False, True, True, True),
    "nemotron_h": (True, False, False, False),
}

pytestmark = pytest.mark.filterwarnings("ignore")


def _config(variant: str, **over: Any) -> Any:
    if variant == "nemotron_h":  # not in TINY_CONFIGS (hybrid): attention + MoE only
        return transformers.NemotronHConfig(
            hidden_size=16, layers_block_type=["attention", "moe"], num_attention_heads=4,
            num_key_value_heads=2, head_dim=4, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=8, moe_shared_expert_intermediate_size=8, vocab_size=64,
            n_group=1, topk_group=1, **over,
        )  # fmt: skip
    return transformers.AutoConfig.for_model(**{**tiny_config(variant), **over})


def _peft(variant: str = "qwen3_moe-dense0", *, params: list[str] | None = None, **over: Any):
    """A peft model (attention + experts LoRA), base seeded, B random."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(_config(variant, **over))
        default = NO_GATE if variant == "nemotron_h" else GATE_UP
        lora = LoraConfig(
            r=RANK,
            lora_alpha=2 * RANK,
            target_modules=["q_proj", "o_proj"],
            target_parameters=default if params is None else params,
        )
        peft_model = get_peft_model(model, lora)
    _randomize_b(peft_model)
    return peft_model


def _randomize_b(model: torch.nn.Module, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)


def _ids(batch: int = 2, seq: int = 12, vocab: int = 64) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(2))


def _step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if experts_lora.is_fused_experts(m)]


@pytest.mark.parametrize("variant", list(FAMILIES))
def test_loss_and_grads_match_peft(variant: str) -> None:
    stock = _peft(variant)
    split = copy.deepcopy(stock)
    switched = apply_split_lora(split)
    assert len(switched) == 2 * len(_experts(split))  # both projections of every MoE layer
    flags = FAMILIES[variant]
    for experts in _experts(split):
        assert (experts.is_concatenated, experts.is_transposed) == flags[:2]
        assert (experts.has_bias, experts.has_gate) == flags[2:]
        assert experts.config._experts_implementation == IMPLEMENTATION
    ids = _ids()
    (loss_ref, grads_ref), (loss, grads) = _step(stock, ids), _step(split, ids)
    assert _rel(loss, loss_ref) <= 1e-5
    assert grads.keys() == grads_ref.keys()
    kinds = {"experts.lora_A", "experts.base_layer.lora_A", "experts.lora_B", "o_proj.lora_A"}
    assert all(any(k in n for n in grads) for k in kinds)  # experts A, B and attention covered
    for name, grad in grads.items():
        assert grad is not None and grad.norm() > 0, name
        assert _rel(grad, grads_ref[name]) <= 1e-5, name
    # frozen expert stacks: no gradient at all
    assert all(p.grad is None for e in _experts(split) for p in e.parameters())
    # experts LoRA moves the logits far more than the tolerance: equality is not vacuous
    with torch.no_grad():
        adapted = split(input_ids=ids).logits
        for name, param in split.named_parameters():
            if "experts" in name and "lora_B" in name:
                param.zero_()
        assert _rel(split(input_ids=ids).logits, adapted) > 1e-3


def test_saved_adapter_loads_with_stock_peft(tmp_path: Any) -> None:
    split = _peft()
    apply_split_lora(split)
    ids = _ids()
    _step(split, ids)  # a training step on the split path changes A and B
    torch.optim.SGD([p for p in split.parameters() if p.requires_grad], lr=0.1).step()
    split.save_pretrained(tmp_path)
    torch.manual_seed(0)  # the same random base, stock experts forward
    base = transformers.AutoModelForCausalLM.from_config(_config("qwen3_moe-dense0"))
    loaded = PeftModel.from_pretrained(base, tmp_path)
    assert base.config._experts_implementation == "grouped_mm"
    with torch.no_grad():
        ours, theirs = split(input_ids=ids).logits, loaded(input_ids=ids).logits
    assert _rel(ours, theirs) <= 1e-5
    keys = loaded.state_dict().keys()
    assert any(k.endswith("mlp.experts.lora_A.default.weight") for k in keys)
    assert any(k.endswith("mlp.experts.base_layer.lora_A.default.weight") for k in keys)


class _Largest(TorchDispatchMode):
    """The largest fresh storage any aten op returns (views and in-place results excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0
        self.op = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        inputs = tree_leaves((args, kwargs))
        seen = {t.untyped_storage()._cdata for t in inputs if isinstance(t, torch.Tensor)}
        fresh = [t.untyped_storage() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        for storage in fresh:
            if storage._cdata not in seen and storage.nbytes() > self.nbytes:
                self.nbytes, self.op = storage.nbytes(), str(func)
        return out


def test_step_never_allocates_an_expert_stack() -> None:
    over = dict(hidden_size=64, num_hidden_layers=1, num_experts=32, moe_intermediate_size=64,
                mlp_only_layers=[], head_dim=16)  # fmt: skip
    stock = _peft(**over)
    split = copy.deepcopy(stock)
    apply_split_lora(split)
    experts = _experts(split)[0]
    stack = min(experts.gate_up_proj.nbytes, experts.down_proj.nbytes)  # 512 KiB
    ids = _ids(batch=1, seq=16)
    found = {}
    for name, model in (("peft", stock), ("split", split)):
        with _Largest() as largest:
            _step(model, ids)
        found[name] = largest
    assert found["peft"].nbytes >= stack, found["peft"].op  # W + s·B·A of the whole stack
    assert found["split"].nbytes <= stack / 4, found["split"].op


def test_expert_dropout_train_vs_eval() -> None:
    stock = _peft()
    split = copy.deepcopy(stock)
    apply_split_lora(split, dropout=0.5)
    wrappers = [m for m in split.modules() if isinstance(m, SplitParamWrapper)]
    assert all(isinstance(w.lora_dropout["default"], torch.nn.Dropout) for w in wrappers)
    ids = _ids()
    split.train()
    with torch.no_grad():
        first, second = split(input_ids=ids).logits, split(input_ids=ids).logits
        assert _rel(first, second) > 1e-4
        split.eval()
        stock.eval()
        assert _rel(split(input_ids=ids).logits, stock(input_ids=ids).logits) <= 1e-5


def test_rank_stays_r_and_state_dict_is_peft() -> None:
    stock = _peft()
    keys = {k: v.shape for k, v in stock.state_dict().items()}
    apply_split_lora(stock)
    assert {k: v.shape for k, v in stock.state_dict().items()} == keys
    for wrapper in (m for m in stock.modules() if isinstance(m, SplitParamWrapper)):
        experts = wrapper.num_experts
        assert wrapper.r["default"] == RANK
        assert wrapper.lora_A["default"].weight.shape[0] == RANK * experts
        assert wrapper.lora_B["default"].weight.shape[1] == RANK * experts


def test_restore_merge_and_adapter_switching() -> None:
    stock = _peft()
    stock.add_adapter("other", LoraConfig(r=2, lora_alpha=2, target_parameters=GATE_UP))
    _randomize_b(stock, seed=3)
    split = copy.deepcopy(stock)
    apply_split_lora(split)
    ids = _ids()
    with torch.no_grad():
        for adapter in ("other", "default"):
            stock.set_adapter(adapter)
            split.set_adapter(adapter)
            assert _rel(split(input_ids=ids).logits, stock(input_ids=ids).logits) <= 1e-5
        reference = stock(input_ids=ids).logits
        restore_peft_lora(split)
        assert not is_split(split)
        assert split.get_base_model().config._experts_implementation == "grouped_mm"
        assert all(type(m) is ParamWrapper for m in split.modules() if isinstance(m, ParamWrapper))
        assert _rel(split(input_ids=ids).logits, reference) <= 1e-5
        apply_split_lora(split)
        merged = split.merge_and_unload()
        assert _rel(merged(input_ids=ids).logits, reference) <= 1e-5


def test_looped_fallback_matches_grouped_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    split = _peft()
    apply_split_lora(split, dropout=0.0)
    ids = _ids()
    loss_ref, grads_ref = _step(split, ids)
    split.zero_grad(set_to_none=True)
    monkeypatch.setattr(experts_lora, "_grouped_kernel_ok", lambda x, w: False)
    loss, grads = _step(split, ids)
    assert _rel(loss, loss_ref) <= 1e-6
    assert all(_rel(g, grads_ref[n]) <= 1e-5 for n, g in grads.items())


def test_registered_base_path_equals_stock() -> None:
    assert IMPLEMENTATION in ALL_EXPERTS_FUNCTIONS
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config("gpt_oss"))
    ids = _ids()
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        model.set_experts_implementation(IMPLEMENTATION)  # no LoRA: base weights only
        assert _rel(model(input_ids=ids).logits, reference) <= 1e-6


def test_refuses_models_without_expert_lora() -> None:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config("qwen3_moe-dense0"))
    attention_only = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(EngineError, match="target_parameters"):
        apply_split_lora(attention_only)
    with pytest.raises(EngineError, match="dropout"):
        apply_split_lora(_peft(), dropout=1.5)


def test_failed_switch_leaves_peft_path(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _peft()
    base = model.get_base_model()
    monkeypatch.setattr(base, "set_experts_implementation", lambda name: None)  # ignores us
    with pytest.raises(EngineError, match="did not route"):
        apply_split_lora(model)
    assert not is_split(model)
    assert all(not hasattr(e, "_moetune_lora") for e in _experts(model))


def test_gradient_checkpointing_replays_dropout_and_matches_peft() -> None:
    stock = _peft()
    split = copy.deepcopy(stock)
    apply_split_lora(split)
    ids = _ids()
    for model in (stock, split):
        base = model.get_base_model()
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base.enable_input_require_grads()
        model.train()
    (loss_ref, grads_ref), (loss, grads) = _step(stock, ids), _step(split, ids)
    assert _rel(loss, loss_ref) <= 1e-5
    assert all(_rel(g, grads_ref[n]) <= 1e-5 for n, g in grads.items())
    # with dropout, the recomputed forward must draw the same masks as the first one
    apply_split_lora(split, dropout=0.3)
    results = []
    for checkpointing in (True, False):
        split.zero_grad(set_to_none=True)
        base = split.get_base_model()
        if not checkpointing:
            base.gradient_checkpointing_disable()
        torch.manual_seed(5)
        results.append(_step(split, ids))
    (loss_gc, grads_gc), (loss_plain, grads_plain) = results
    assert _rel(loss_gc, loss_plain) <= 1e-6
    assert all(_rel(g, grads_plain[n]) <= 1e-5 for n, g in grads_gc.items())
