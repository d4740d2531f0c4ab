"""Tiny transformers models for the probes: a 2-layer, 4-expert, hidden-16 causal LM of a
family, peft's view of which modules it adapts, and quiet library logs.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn


_TINY = dict(
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    vocab_size=32,
    intermediate_size=32,
    num_experts_per_tok=2,
)


_TINY_MOE: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=8),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=8, shared_expert_intermediate_size=16),
    "gpt_oss": dict(num_local_experts=4),
    # layer 0 dense (first_k_dense_replace), layer 1 MoE with one shared expert
    "deepseek_v3": dict(
        n_routed_experts=4,
        moe_intermediate_size=8,
        first_k_dense_replace=1,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=None,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
    ),
}


def tiny_model(model_type: str, device: str = "meta", dtype: Any = None) -> nn.Module:
    """A 2-layer, 4-expert, hidden-16 causal LM of `model_type` (random or weightless)."""
    # lazy: heavy to import (torch, transformers)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **_TINY, **_TINY_MOE[model_type])
    with _quiet(), torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype or torch.bfloat16)


@contextmanager
def _quiet() -> Iterator[None]:
    """peft/transformers warnings (rank_pattern mismatch, tiny-vocab eos) are noise here."""
    # lazy: heavy to import (transformers)
    from transformers.utils import logging as tf_logging

    level = tf_logging.get_verbosity()
    tf_logging.set_verbosity(logging.CRITICAL)  # errors too: the gguf probe expects one
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        tf_logging.set_verbosity(level)


def adapted_modules(model: nn.Module, **lora: Any) -> set[str]:
    """Wrap `model` with LoraConfig(r=2, **lora); names (from `layers.`) that got a lora_A."""
    # lazy: heavy to import (peft)
    from peft import LoraConfig, get_peft_model

    with _quiet():
        peft_model = get_peft_model(model, LoraConfig(r=2, **lora))
    names = set()
    for name, _ in peft_model.named_parameters():
        if ".lora_A." in name and "layers." in name:
            module = name.split(".lora_A.")[0]
            names.add(module[module.index("layers.") :].replace(".base_layer", ""))
    return names


def _version(lib: str) -> str:
    try:
        return metadata.version(lib)
    except metadata.PackageNotFoundError:
        return "absent"
