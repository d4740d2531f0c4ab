"""Per-model_type knowledge no transformers build shows: mlx-lm's module names (its
`lora_parameters.keys`) and peft's behaviour on the fused experts. Counts, components,
peft paths, layouts and layer prefixes are read off the build (model.derive), so a type
missing here still plans and trains on peft; it only has no mlx recipe.

Importing moetune.model registers these.
"""

from __future__ import annotations

from typing import Any

from moetune.model.families.registry import Override, register

GLU = ("gate_proj", "up_proj", "down_proj")


def under(prefix: str, names: tuple[str, ...] = GLU) -> tuple[str, ...]:
    """`names` below one module: under("mlp.shared_experts") -> mlp.shared_experts.gate_proj, …"""
    return tuple(f"{prefix}.{n}" for n in names)


# mlx-lm's attention keys; only those whose projection the build has are kept (DeepSeek:
# q_proj without q_lora_rank, q_a_proj/q_b_proj with it).
ATTENTION = under("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj"))
MLA = under("self_attn", ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                          "o_proj"))  # fmt: skip


SCONV_RENAMED = (
    "transformers' checkpoint conversion renames sconv.weight_proj to sconv.weight_proj.weight "
    "on load and peft's PeftModel.from_pretrained renames an adapter's keys the same way, so "
    "a LoRA on it would not load back (its dynamic short convolution stays frozen)"
)


def _switch(model_type: str, block: str, router: str, **quirks: Any) -> Override:
    """An experts-only MoE block, mlx-lm's SwitchGLU stacks in `<block>.switch_mlp`."""
    return Override(
        model_type,
        mlx_attention=ATTENTION,
        mlx_experts=under(f"{block}.switch_mlp"),
        mlx_dense=under(block),
        mlx_router=(f"{block}.{router}",),
        **quirks,
    )


def _dense(model_type: str) -> Override:
    return Override(model_type, mlx_attention=ATTENTION, mlx_dense=under("mlp"))


def _shared(model_type: str, attention: tuple[str, ...], shared: str, router: tuple[str, ...],
            **quirks: Any) -> Override:  # fmt: skip
    """A MoE block with shared experts beside the SwitchGLU stacks."""
    return Override(
        model_type,
        mlx_attention=attention,
        mlx_experts=under("mlp.switch_mlp"),
        mlx_dense=under("mlp"),
        mlx_shared=under(f"mlp.{shared}"),
        mlx_router=router,
        **quirks,
    )


register(
    *(_dense(t) for t in ("llama", "qwen2", "qwen3", "mistral")),
    # peft 0.21 has no conversion mapping for qwen2_moe
    _shared("qwen2_moe", ATTENTION, "shared_expert", ("mlp.gate",), peft_automap=False),
    _switch("qwen3_moe", "mlp", "gate"),
    _switch("olmoe", "mlp", "gate"),
    # peft maps only the checkpoint names w1/w2/w3 here
    _switch(
        "mixtral",
        "block_sparse_moe",
        "gate",
        peft_automap=False,
        peft_automap_names=("w1", "w2", "w3"),
    ),
    # mlx-lm's granitemoe keeps experts outside SwitchLinear in the versions checked
    _switch("granitemoe", "block_sparse_moe", "router", peft_automap=False, mlx_supported=False),
    _switch("phimoe", "block_sparse_moe", "gate", peft_automap=False),
    Override(
        "gpt_oss",
        mlx_attention=ATTENTION,
        mlx_experts=under("mlp.experts"),
        mlx_router=("mlp.router",),
        peft_automap=False,
    ),
    # mlx-lm's MoEGate is not a Linear: never adaptable
    _shared("glm4_moe", ATTENTION, "shared_experts", ()),
    _shared("deepseek_v2", MLA, "shared_experts", ()),
    _shared("deepseek_v3", MLA, "shared_experts", ()),
    # mlx-lm module names not verified here: no mlx recipe
    Override("ernie4_5_moe", mlx_supported=False),
    Override("hunyuan_v1_moe", mlx_supported=False),
    Override("jamba", peft_automap=False, mlx_supported=False),
    # mlx-lm keeps one Linear per expert: no SwitchLinear to adapt
    Override("dbrx", peft_automap=False, mlx_supported=False),
    # transformers' inkling2_text conversion renames `sconv.weight_proj` (a bare tensor in
    # the checkpoint) to `sconv.weight_proj.weight` (a Linear's), and peft's load renames an
    # adapter's keys the same way: a LoRA on it would land on no module
    Override(
        "inkling2_text",
        peft_automap=False,
        mlx_supported=False,
        aliases=("inkling2_loop_text",),
        left_out=(("sconv.weight_proj", SCONV_RENAMED),),
    ),
    Override(
        "llama4",
        mlx_attention=ATTENTION,
        peft_automap=False,
        mlx_supported=False,
        aliases=("llama4_text",),
    ),
)
