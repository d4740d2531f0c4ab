"""Tiny config.json dicts for every registered family (hidden 16, 2–4 layers, 4 experts).

Variants cover dense first layers, shared experts, biases, tied embeddings and aliased
field names; tests build each on the meta device and compare with its ModelSpec. Other
stages (trace, recipe) can reuse them to exercise every family.
"""

from __future__ import annotations

import copy
from typing import Any

_BASE: dict[str, Any] = {
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _cfg(model_type: str, **over: Any) -> dict[str, Any]:
    return {**_BASE, "model_type": model_type, **over}


# MLA attention needs as many kv heads as query heads to run a forward.
_MLA = {"num_key_value_heads": 4, "kv_lora_rank": 8, "qk_nope_head_dim": 4,
        "qk_rope_head_dim": 4, "v_head_dim": 6, "n_group": 1, "topk_group": 1}  # fmt: skip

# (id, config): ids name the variant so a failure says which shape broke.
_VARIANTS: list[tuple[str, dict[str, Any]]] = [
    (
        "qwen2_moe-shared-dense0",
        _cfg(
            "qwen2_moe",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=12,
            mlp_only_layers=[0],
        ),
    ),
    (
        "qwen2_moe-step2-noqkvbias",
        _cfg(
            "qwen2_moe",
            num_hidden_layers=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=20,
            decoder_sparse_step=2,
            qkv_bias=False,
        ),
    ),
    (
        "qwen3_moe-dense0",
        _cfg(
            "qwen3_moe",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            mlp_only_layers=[0],
            head_dim=8,
        ),
    ),
    (
        "qwen3_moe-tied-local_experts",
        _cfg(
            "qwen3_moe",
            num_local_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            tie_word_embeddings=True,
            attention_bias=True,
        ),
    ),
    ("olmoe", _cfg("olmoe", num_experts=4, num_experts_per_tok=2)),
    ("mixtral", _cfg("mixtral", num_local_experts=4, num_experts_per_tok=2)),
    ("mixtral-alias-num_experts", _cfg("mixtral", num_experts=6, num_experts_per_tok=2)),
    (
        "deepseek_v2-lite-like",
        _cfg(
            "deepseek_v2",
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            n_shared_experts=2,
            first_k_dense_replace=1,
            q_lora_rank=None,
            **_MLA,
        ),
    ),
    (
        "deepseek_v2-biases-qlora",
        _cfg(
            "deepseek_v2",
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            n_shared_experts=1,
            first_k_dense_replace=2,
            q_lora_rank=6,
            attention_bias=True,
            mlp_bias=True,
            **_MLA,
        ),
    ),
    (
        "deepseek_v3",
        _cfg(
            "deepseek_v3",
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=6,
            **_MLA,
        ),
    ),
    (
        "deepseek_v3-direct-q",
        _cfg(
            "deepseek_v3",
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            n_shared_experts=2,
            first_k_dense_replace=0,
            q_lora_rank=None,
            **_MLA,
        ),
    ),
    ("gpt_oss", _cfg("gpt_oss", num_local_experts=4, num_experts_per_tok=2, head_dim=4)),
    (
        "granitemoe-bias",
        _cfg("granitemoe", num_local_experts=4, num_experts_per_tok=2, attention_bias=True),
    ),
    (
        "phimoe-biases",
        _cfg(
            "phimoe",
            num_local_experts=4,
            num_experts_per_tok=2,
            attention_bias=True,
            lm_head_bias=True,
        ),
    ),
    (
        "glm4_moe-qknorm",
        _cfg(
            "glm4_moe",
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            use_qk_norm=True,
            attention_bias=True,
        ),
    ),
    (
        "jamba",
        _cfg(
            "jamba",
            num_hidden_layers=4,
            num_experts=4,
            num_experts_per_tok=2,
            expert_layer_period=2,
            expert_layer_offset=1,
            attn_layer_period=2,
            attn_layer_offset=0,
            mamba_d_state=4,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank="auto",
        ),
    ),
    (
        "jamba-projbias",
        _cfg(
            "jamba",
            num_hidden_layers=4,
            num_experts=4,
            num_experts_per_tok=2,
            expert_layer_period=4,
            expert_layer_offset=3,
            attn_layer_period=4,
            attn_layer_offset=1,
            mamba_d_state=4,
            mamba_d_conv=3,
            mamba_expand=1,
            mamba_dt_rank=3,
            mamba_proj_bias=True,
            mamba_conv_bias=False,
        ),
    ),
    (
        "dbrx",
        {
            "model_type": "dbrx",
            "d_model": 16,
            "n_layers": 2,
            "n_heads": 4,
            "vocab_size": 64,
            "max_seq_len": 64,
            "attn_config": {"kv_n_heads": 2, "rope_theta": 500000, "clip_qkv": 8.0},
            "ffn_config": {"moe_num_experts": 4, "moe_top_k": 2, "ffn_hidden_size": 8},
        },
    ),
    (
        "llama4_text-interleave2",
        _cfg(
            "llama4_text",
            num_local_experts=4,
            num_experts_per_tok=1,
            intermediate_size_mlp=20,
            interleave_moe_layer_step=2,
            head_dim=4,
        ),
    ),
    (
        "llama4-wrapped",
        {
            "model_type": "llama4",
            "text_config": _cfg(
                "llama4_text",
                num_local_experts=4,
                num_experts_per_tok=1,
                intermediate_size_mlp=20,
                moe_layers=[0, 2],
                head_dim=4,
            ),
            "vision_config": {"hidden_size": 16},
        },
    ),
    (
        "ernie4_5_moe-bias-tied",
        _cfg(
            "ernie4_5_moe",
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=8,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            use_bias=True,
        ),
    ),
    (
        "ernie4_5_moe-interval2",
        _cfg(
            "ernie4_5_moe",
            num_hidden_layers=4,
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=8,
            moe_num_shared_experts=0,
            moe_layer_start_index=0,
            moe_layer_interval=2,
            tie_word_embeddings=False,
        ),
    ),
    ("hunyuan_v1_moe", _cfg("hunyuan_v1_moe", num_experts=4, moe_topk=[2, 2, 2], head_dim=4)),
    ("llama-biases", _cfg("llama", attention_bias=True, mlp_bias=True)),
    ("qwen2", _cfg("qwen2")),
    ("qwen3-tied", _cfg("qwen3", head_dim=8, tie_word_embeddings=True)),
    ("mistral", _cfg("mistral")),
]

TINY_CONFIGS: dict[str, dict[str, Any]] = dict(_VARIANTS)


def tiny_config(variant: str) -> dict[str, Any]:
    """A fresh copy of one tiny config (ids as in TINY_CONFIGS, e.g. "qwen3_moe-dense0")."""
    return copy.deepcopy(TINY_CONFIGS[variant])
