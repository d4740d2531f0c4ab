"""How serving stacks take each family's expert LoRA: facts read off vLLM's and llama.cpp's
sources, kept here so both the exporters (moetune.export) and the lint rules
(moetune.lint.rules.serve) use one table."""

from __future__ import annotations

from dataclasses import dataclass

IGNORED = "users report adapters that load and change nothing"
# the only --max-lora-rank values vLLM 0.32's LoRAConfig accepts (2 is refused at startup)
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class VllmFamily:
    """vLLM's model class for a family and how it takes expert LoRA: "3d" (the class sets
    is_3d_moe_weight: peft's fused adapter as is), "2d" (per-expert keys
    `experts.N.gate_proj.lora_A`; a fused adapter needs --enable-mixed-moe-lora-format and
    is_3d_lora_weight=True), "ignored" (expert LoRA loads and changes nothing)."""

    vllm_class: str
    experts: str
    why: str = ""


# vllm/model_executor/models/*.py (0.32): `is_3d_moe_weight` and SupportsLoRA per class.
VLLM_FAMILIES: dict[str, VllmFamily] = {
    "qwen3_moe": VllmFamily("Qwen3MoeForCausalLM", "2d"),
    "qwen2_moe": VllmFamily("Qwen2MoeForCausalLM", "2d"),
    "olmoe": VllmFamily("OlmoeForCausalLM", "2d"),
    "mixtral": VllmFamily("MixtralForCausalLM", "2d"),
    "deepseek_v2": VllmFamily("DeepseekV2ForCausalLM", "2d"),
    "deepseek_v3": VllmFamily("DeepseekV3ForCausalLM", "2d"),
    "gpt_oss": VllmFamily("GptOssForCausalLM", "3d"),
    "qwen3_5_moe": VllmFamily("Qwen3_5MoeForConditionalGeneration", "3d"),
    "gemma4": VllmFamily("Gemma4ForConditionalGeneration", "ignored", IGNORED),
    "nemotron_h": VllmFamily("NemotronHForCausalLM", "ignored", IGNORED),
    "kimi_linear": VllmFamily("KimiLinearForCausalLM", "ignored", IGNORED),
}


@dataclass(frozen=True)
class GgufFamily:
    """How llama.cpp names one transformers family: its gguf MODEL_ARCH member, how its
    converter splits the fused gate_up expert stack ("halves" or "interleaved"), and whether
    it permutes the q/k rows (LLAMA's rope layout) – then `heads` holds the model's
    (n_head, n_head_kv), read from its config at export time – and `rename` (transformers'
    module path, the path gguf's tensor map knows) where the two differ; `unserved`: modules
    whose LoRA llama.cpp does not apply (refused at export rather than dropped when served)."""

    arch: str
    gate_up: str = "halves"
    permute_qk: bool = False
    heads: tuple[int, int] | None = None
    rename: tuple[str, str] | None = None
    unserved: tuple[str, ...] = ()


# convert_hf_to_gguf.py (conversion/qwen.py, olmo.py, gpt_oss.py): these keep q/k as they
# are, so attention LoRA maps 1:1; experts become blk.N.ffn_{gate,up,down}_exps.
# conversion/llama.py takes MixtralForCausalLM as LLAMA: q rows permuted per head
# (reshape(n_head, 2, d/2, in).swapaxes(1, 2)), k the same with n_head_kv; experts w1/w3/w2
# stacked to ffn_gate/up/down_exps (transformers fuses them as gate_up = [w1; w3]).
# conversion/granite.py: GraniteMoe is a LlamaModel (same q/k permutation); its converter
# splits input_linear (transformers: block_sparse_moe.experts.gate_up_proj) in halves,
# gate first, names the halves itself; the tensor map knows the mlp.experts.* spelling.
# conversion/deepseek.py (DEEPSEEK2 for DeepseekV3ForCausalLM): o_proj, the shared expert,
# the dense layers and the per-expert checkpoint (stacked to ffn_*_exps) map 1:1 and take
# LoRA. Not served: kv_b_proj becomes per-head k_b (transposed) and v_b for the absorbed
# attention (ΔW = B @ A has no such split), and llama.cpp's deepseek2 graph multiplies
# q_a / q_b / kv_a_mqa (and q_proj) with plain ggml_mul_mat, so a LoRA there is loaded and
# silently ignored (b11549: logits as without it).
GGUF_FAMILIES: dict[str, GgufFamily] = {
    "qwen3_moe": GgufFamily("QWEN3MOE"),
    "qwen2_moe": GgufFamily("QWEN2MOE"),
    "olmoe": GgufFamily("OLMOE"),
    "gpt_oss": GgufFamily("GPT_OSS", gate_up="interleaved"),
    "mixtral": GgufFamily("LLAMA", permute_qk=True),
    "deepseek_v3": GgufFamily(
        "DEEPSEEK2", unserved=("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
    ),
    "granitemoe": GgufFamily(
        "GRANITE_MOE", permute_qk=True, rename=(".block_sparse_moe.experts.", ".mlp.experts.")
    ),
}
