"""Probes of the peft / transformers traps: LoRA that never reaches the experts, a router
adapted, bitsandbytes that leaves experts bf16, experts that do not dispatch.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any
from unittest import mock

from moetune.lint.probes.tiny import _quiet, adapted_modules, tiny_model
from moetune.lint.registry import ProbeOutcome
from moetune.model import spec_from_config
from moetune.model.census import shrunk_config
from moetune.model.derive import build_language_model
from moetune.model.hf_config import hf_config_object
from moetune.model.tiny import tiny_config as tiny_moe_config

if TYPE_CHECKING:
    from torch import nn


# peft's exact words (peft/tuners/lora/layer.py, ParamWrapper); rules quote them.
PEFT_DROPOUT_TEXT = "lora.ParamWrapper does not work with lora_dropout != 0"


EXPERT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


GLU_NAMES = ["gate_proj", "up_proj", "down_proj"]


def moe_lora_dropout() -> ProbeOutcome:
    """peft refuses lora_dropout != 0 on fused expert parameters."""
    model = tiny_model("qwen3_moe")
    try:
        adapted_modules(model, target_parameters=list(EXPERT_PARAMS), lora_dropout=0.1)
    except ValueError as err:
        return ProbeOutcome(PEFT_DROPOUT_TEXT in str(err), f"get_peft_model raised: {err}")
    return ProbeOutcome(False, "get_peft_model accepted lora_dropout=0.1 on fused experts")


def quantized_experts_peft() -> ProbeOutcome:
    """peft matches target_parameters only among Parameters: on experts stored quantised
    (buffers) it silently adapts nothing."""
    # lazy: heavy to import (torch, moetune.engine)
    import torch

    from moetune.engine.quant.stacks import quantize_experts_

    model = tiny_model("qwen3_moe", device="cpu", dtype=torch.float32)
    quantize_experts_(model, "int8", error_experts=0)
    try:  # attention too, as in a real recipe: the experts then go missing without a word
        adapted = adapted_modules(
            model, target_modules=["q_proj"], target_parameters=list(EXPERT_PARAMS)
        )
    except ValueError as err:  # a peft that refuses instead of skipping: the trap is gone
        return ProbeOutcome(False, f"get_peft_model raised instead: {err}")
    experts = sorted(n for n in adapted if "experts" in n)
    attention = sorted(n for n in adapted if "q_proj" in n)
    return ProbeOutcome(
        bool(attention) and not experts,
        f"adapted on quantised stacks: {len(attention)} q_proj, experts {experts or 'none'}",
    )


def _bnb_replaced(model: nn.Module) -> set[str]:
    """Modules transformers' bitsandbytes integration swaps for quantized ones (bnb itself is
    stubbed, so the selection logic runs without the library or a GPU)."""
    # lazy: heavy to import (torch, transformers)
    import torch
    from transformers import BitsAndBytesConfig
    from transformers.integrations import bitsandbytes as tf_bnb

    class QuantizedStub(torch.nn.Module):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__()

    stub = SimpleNamespace(nn=SimpleNamespace(Linear4bit=QuantizedStub, Linear8bitLt=QuantizedStub))
    with mock.patch.object(tf_bnb, "bnb", stub, create=True):
        tf_bnb.replace_with_bnb_linear(
            model, ["lm_head"], quantization_config=BitsAndBytesConfig(load_in_4bit=True)
        )
    return {n for n, m in model.named_modules() if isinstance(m, QuantizedStub)}


def _kbit_prepared_expert_dtype() -> str:
    """dtype of a bf16 fused expert stack after peft's prepare_model_for_kbit_training."""
    # lazy: heavy to import (peft)
    from peft import prepare_model_for_kbit_training

    model = tiny_model("qwen3_moe", device="cpu")
    with _quiet():
        prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return str(dict(model.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"].dtype)


def moe_4bit_bnb() -> ProbeOutcome:
    """bnb replaces only nn.Linear (experts stay bf16); kbit prep upcasts them to fp32."""
    replaced = _bnb_replaced(tiny_model("qwen3_moe"))
    experts_quantized = any(".experts" in n for n in replaced)
    attention_quantized = "model.layers.0.self_attn.q_proj" in replaced
    dtype = _kbit_prepared_expert_dtype()
    present = attention_quantized and not experts_quantized and dtype == "torch.float32"
    evidence = (
        f"bnb replacement quantized {len(replaced)} Linear modules, experts among them: "
        f"{experts_quantized}; prepare_model_for_kbit_training left the bf16 expert stack as "
        f"{dtype}"
    )
    return ProbeOutcome(present, evidence)


def peft_automap_drops_mlp() -> ProbeOutcome:
    """deepseek_v3: gate/up/down names are remapped to experts; dense + shared MLPs lose LoRA."""
    got = adapted_modules(tiny_model("deepseek_v3"), target_modules=[*GLU_NAMES, "o_proj"])
    dense = any(n.startswith("layers.0.mlp.") for n in got)
    shared = any(".shared_experts." in n for n in got)
    experts = "layers.1.mlp.experts" in got
    evidence = (
        f"target_modules gate/up/down_proj on a tiny deepseek_v3 adapted: dense MLP {dense}, "
        f"shared experts {shared}, routed experts {experts}"
    )
    return ProbeOutcome(experts and not dense and not shared, evidence)


def peft_qwen2moe_unmapped() -> ProbeOutcome:
    """qwen2_moe: gate/up/down names reach only the shared expert, never the fused experts."""
    got = adapted_modules(tiny_model("qwen2_moe"), target_modules=GLU_NAMES)
    experts = any(n.endswith("mlp.experts") for n in got)
    shared = any(".shared_expert." in n for n in got)
    evidence = f"qwen2_moe with gate/up/down_proj: routed experts {experts}, shared {shared}"
    return ProbeOutcome(shared and not experts, evidence)


def lora_router_targeted() -> ProbeOutcome:
    """ "all-linear" also adapts the qwen3_moe router (mlp.gate, via target_parameters)."""
    got = adapted_modules(tiny_model("qwen3_moe"), target_modules="all-linear")
    router = sorted(n for n in got if n.endswith("mlp.gate"))
    return ProbeOutcome(bool(router), f"all-linear on qwen3_moe adapted routers: {router}")


def lora_no_experts() -> ProbeOutcome:
    """gpt_oss has no peft name mapping: "all-linear" silently leaves every expert frozen."""
    got = adapted_modules(tiny_model("gpt_oss"), target_modules="all-linear")
    experts = sorted(n for n in got if ".experts" in n)
    evidence = f"all-linear on gpt_oss raised nothing and adapted {len(got)} modules, experts: "
    return ProbeOutcome(bool(got) and not experts, evidence + str(experts))


def experts_not_dispatched() -> ProbeOutcome:
    """transformers builds some MoE families' experts without @use_experts_implementation
    (dbrx here), so moetune's split LoRA has no ExpertsInterface to plug into."""
    # lazy: heavy to import (moetune.engine)
    from moetune.engine.resolve import split_engine_serves

    served = split_engine_serves(spec_from_config(tiny_moe_config("dbrx"), "tiny-dbrx"))
    verb = "dispatch" if served else "do not dispatch"
    return ProbeOutcome(not served, f"dbrx experts {verb} through ExpertsInterface")


def gradient_checkpointing_unsupported() -> ProbeOutcome:
    """Some causal-LM classes (jetmoe on transformers 5.24) refuse activation checkpointing:
    `gradient_checkpointing_enable()` raises at the trainer's setup, after the model loaded."""
    model = build_language_model(hf_config_object("jetmoe", shrunk_config("jetmoe")), "jetmoe")
    try:
        model.gradient_checkpointing_enable()
    except ValueError as exc:
        return ProbeOutcome(True, f"jetmoe: {exc}")
    return ProbeOutcome(False, "jetmoe now supports gradient checkpointing")
