"""`lora.engine: auto` resolves to moetune's split LoRA exactly where it serves, and there
its loss and gradients equal peft's (so auto never changes what a run learns)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import transformers
from peft import get_peft_model

from moetune.config import LoraArgs
from moetune.engine import apply_split_lora
from moetune.engine.resolve import resolve_engine, split_engine_serves
from moetune.errors import RecipeError
from moetune.model import load_spec, spec_from_config
from moetune.model.spec import ModelSpec
from moetune.model.tiny import TINY_CONFIGS, tiny_config
from moetune.recipe.targets import build_peft_config
from test_engine_experts_lora import _randomize_b, _rel, _step

pytestmark = pytest.mark.filterwarnings("ignore")


def _spec(variant: str) -> ModelSpec:
    return spec_from_config(tiny_config(variant), variant)


MOE_VARIANTS = [v for v in TINY_CONFIGS if _spec(v).is_moe]
SERVED = [v for v in MOE_VARIANTS if split_engine_serves(_spec(v))]


def test_auto_picks_moetune_only_where_transformers_dispatches_the_experts() -> None:
    qwen = load_spec("Qwen/Qwen3-30B-A3B")
    assert resolve_engine(qwen, LoraArgs()) == "moetune"
    assert resolve_engine(qwen, LoraArgs(targets=["attention"])) == "peft"  # no expert LoRA
    assert resolve_engine(qwen, LoraArgs(engine="peft")) == "peft"
    assert resolve_engine(qwen, LoraArgs(stack="mlx")) == "peft"
    dbrx = _spec("dbrx")
    assert resolve_engine(dbrx, LoraArgs()) == "peft"
    with pytest.raises(RecipeError, match="cannot serve dbrx"):
        resolve_engine(dbrx, LoraArgs(engine="moetune"))
    # the families served today, as probed on the installed transformers
    assert {"dbrx", "llama4_text-interleave2"} <= set(MOE_VARIANTS) - set(SERVED)
    assert {"qwen3_moe-dense0", "olmoe", "mixtral", "deepseek_v3", "gpt_oss"} <= set(SERVED)


def _peft_model(variant: str) -> Any:
    """moetune's own recipe (attention + experts, explicit) on a seeded tiny model, B random."""
    spec = _spec(variant)
    lora = LoraArgs(rank=4, engine="moetune", targets=["attention", "experts"])
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.AutoConfig.for_model(**tiny_config(variant))
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        peft_model = get_peft_model(model, build_peft_config(spec, lora))
    _randomize_b(peft_model)
    return peft_model


def _float64_reference(model: Any) -> Any:
    """A float64 copy on transformers' eager experts (grouped_mm has no float64 kernel)."""
    ref = copy.deepcopy(model).double()
    for module in ref.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_experts_implementation"):
            config._experts_implementation = "eager"
    return ref


def _seeded_step(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    torch.manual_seed(3)  # routers with training-time jitter (phimoe) draw the same noise
    return _step(model, ids)


@pytest.mark.parametrize("variant", SERVED)
def test_where_auto_picks_moetune_it_matches_peft(variant: str) -> None:
    # Both fp32 paths are measured against a float64 truth: split LoRA must be as close to
    # it as peft's own fp32 path (within 3x, floor 3e-5), which holds on any CPU's
    # reduction order - ill-conditioned gradients (hunyuan's q_proj) err ~1.6e-5 in peft too,
    # and with other thread counts split LoRA's reached 1.02e-5 where peft's was 3.3e-6.
    stock = _peft_model(variant)
    split = copy.deepcopy(stock)
    assert apply_split_lora(split)
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    loss_64, grads_64 = _seeded_step(_float64_reference(stock), ids)
    (loss_ref, grads_ref), (loss, grads) = _seeded_step(stock, ids), _seeded_step(split, ids)
    experts = [n for n in grads if "experts" in n and "lora_" in n]
    assert experts and grads.keys() == grads_ref.keys() == grads_64.keys()
    pairs = [(loss, loss_ref, loss_64), *((grads[n], grads_ref[n], grads_64[n]) for n in grads)]
    for ours, peft_fp32, truth in pairs:
        bound = max(3e-5, 3 * _rel(peft_fp32.double(), truth))
        assert _rel(ours.double(), truth) <= bound


def test_dropout_reaches_every_lora_layer_on_moetunes_engine() -> None:
    from moetune.config import RunConfig
    from moetune.train.model import _split_and_dropout

    spec = _spec("qwen3_moe-dense0")
    cfg = RunConfig.model_validate({"lora": {"dropout": 0.1, "targets": ["attention", "experts"]}})
    config = build_peft_config(spec, cfg.lora)
    assert config.lora_dropout == 0.0  # peft's ParamWrapper would refuse it
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**tiny_config("qwen3_moe-dense0"))
    )
    wrapped = get_peft_model(model, config)
    _split_and_dropout(wrapped, cfg, resolve_engine(spec, cfg.lora), config.lora_dropout)
    dropouts = [m.lora_dropout["default"] for m in wrapped.modules() if hasattr(m, "lora_dropout")]
    assert len(dropouts) == 3 * 4 + 2 * 2  # q,k,v,o of 3 layers; 2 stacks of 2 MoE layers
    assert all(isinstance(d, torch.nn.Dropout) and d.p == 0.1 for d in dropouts)
