"""GGUF quantization: bytes per weight of each ggml type, and which type llama.cpp's
`llama-quantize` gives each tensor for a file type (Q4_K_M mixes several).

Facts from llama.cpp (ggml's type traits; src/llama-quant.cpp `llama_tensor_get_type_impl`,
`tensor_type_fallback`, `tensor_allows_quantization`), modelled for the file types below:

- a file type has a default ggml type (Q4_K_M → Q4_K); 1-D tensors, norms, biases and the
  router (`ffn_gate_inp`) are never quantized – `convert_hf_to_gguf.py` writes them F32;
- the output head (or the token embeddings when tied) becomes Q6_K unless the file type is
  Q8_0 (or its rows do not divide into 256-blocks: Q8_0); MXFP4_MOE: Q8_0;
- attn_v-like tensors (attn_v, attn_qkv, attn_kv_b) and ffn_down (dense, shared or the
  routed stacks, by layer) take more bits in some layers: Q4_K_M / Q5_K_M use Q6_K where
  `use_more_bits(i, n)` (the first and last eighth of the layers and every third between);
  Q4_K_S uses Q5_K on the first 4 attn_v and the first eighth's ffn_down; Q4_K_M's attn_qkv
  is Q5_K; with exactly 8 experts (Mixtral) attn_v / attn_k are Q8_0 and Q4_K_M's
  attn_output Q5_K;
- a row length (the tensor's input features) that 256 does not divide falls back: Q4_K →
  Q5_0, Q5_K → Q5_1, Q6_K → Q8_0 (F16 if 32 does not divide either);
- MXFP4_MOE: the routed-expert stacks MXFP4, every other quantizable tensor Q8_0.

Approximate: tensor names follow transformers' module names mapped onto llama.cpp's
categories (q/k/v/o_proj, gate/up/down_proj, kv_b_proj, embed_tokens, lm_head); newer
converters split MLA's kv_b into attn_k_b / attn_v_b, which take the default type instead;
an importance matrix or `--tensor-type` overrides change nothing here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moetune.errors import ConfigError

# bytes per block / weights per block (ggml type traits)
BLOCKS: dict[str, tuple[int, int]] = {
    "F32": (4, 1), "F16": (2, 1), "BF16": (2, 1),
    "Q8_0": (34, 32), "Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32), "Q5_1": (24, 32),
    "Q4_K": (144, 256), "Q5_K": (176, 256), "Q6_K": (210, 256), "MXFP4": (17, 32),
}  # fmt: skip
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
ATTN_V = ("attn_v", "attn_qkv", "attn_kv_b")


def type_bytes(ggml_type: str, numel: int) -> float:
    """Bytes of `numel` weights stored as `ggml_type`."""
    size, block = BLOCKS[ggml_type]
    return numel * size / block


def is_quantized(ggml_type: str) -> bool:
    return BLOCKS[ggml_type][1] > 1


@dataclass(frozen=True)
class Tensor:
    """One GGUF tensor: its llama.cpp category, layer, size and row length."""

    name: str  # transformers' parameter name (gate_up stacks: ":gate" / ":up" halves)
    category: str  # token_embd, output, attn_q/k/v/qkv/kv_b/output, ffn_gate/up/down, …
    layer: int | None
    numel: int
    ncols: int  # row length (input features): quant blocks run along it
    quantizable: bool  # False: norms, biases, routers (kept F32)
    routed: bool = False  # a routed-expert stack (what --n-cpu-moe moves to the CPU)


@dataclass
class Context:
    """What llama-quantize knows while it walks the tensors in layer order."""

    n_layer: int
    n_expert: int
    n_attention_wv: int
    tied: bool
    i_attention_wv: int = 0


Rule = Callable[[Tensor, Context, str], str]


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _k_rules(ftype: str) -> Rule:
    """The Q4_K_M / Q4_K_S / Q5_K_M / Q5_K_S / Q6_K / Q8_0 / Q4_0 … branch of llama.cpp."""

    def rule(t: Tensor, ctx: Context, default: str) -> str:
        cat, layer = t.category, t.layer or 0
        if cat in ATTN_V:
            i, ctx.i_attention_wv = ctx.i_attention_wv, ctx.i_attention_wv + 1
            if ctx.n_expert == 8:
                return "Q8_0"
            if cat == "attn_qkv" and ftype in ("Q4_K_M", "Q5_K_M"):
                return "Q5_K" if ftype == "Q4_K_M" else "Q6_K"
            if ftype in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, ctx.n_attention_wv):
                return "Q6_K"
            return "Q5_K" if ftype == "Q4_K_S" and i < 4 else default
        if cat == "attn_k" and ctx.n_expert == 8:
            return "Q8_0"
        if cat == "ffn_down":
            if ftype in ("Q4_K_M", "Q5_K_M") and use_more_bits(layer, ctx.n_layer):
                return "Q6_K"
            return "Q5_K" if ftype == "Q4_K_S" and layer < ctx.n_layer // 8 else default
        if cat == "attn_output" and ctx.n_expert == 8 and ftype in ("Q4_K_M", "Q4_K_S"):
            return "Q5_K"
        return default

    return rule


def _mxfp4_moe(t: Tensor, ctx: Context, default: str) -> str:
    return "MXFP4" if t.routed else "Q8_0"


@dataclass(frozen=True)
class FileType:
    """One `llama-quantize` file type: its default ggml type and per-tensor rule."""

    name: str
    default: str
    rule: Rule | None  # None: every quantizable tensor at `default` (F16, BF16, F32)

    def tensor_type(self, t: Tensor, ctx: Context) -> str:
        if not t.quantizable:
            return "F32"
        if self.rule is None:
            return self.default
        if t.category == "output" or (ctx.tied and t.category == "token_embd"):
            return self._output(t)
        return _fallback(self.rule(t, ctx, self.default), t.ncols)

    def _output(self, t: Tensor) -> str:
        if self.name == "MXFP4_MOE" or t.ncols % BLOCKS[self.default][1]:
            return "Q8_0"
        return "Q8_0" if self.default == "Q8_0" else "Q6_K"


def _fallback(ggml_type: str, ncols: int) -> str:
    if ncols % BLOCKS[ggml_type][1] == 0:
        return ggml_type
    other = FALLBACK.get(ggml_type, ggml_type)
    return other if ncols % BLOCKS[other][1] == 0 else "F16"


FILE_TYPES: dict[str, FileType] = {}


def register(ftype: FileType) -> None:
    FILE_TYPES[ftype.name] = ftype


for _name in ("F32", "F16", "BF16"):
    register(FileType(_name, _name, None))
for _name, _default in (("Q8_0", "Q8_0"), ("Q4_0", "Q4_0"), ("Q4_1", "Q4_1"), ("Q5_0", "Q5_0"),
                        ("Q5_1", "Q5_1"), ("Q6_K", "Q6_K"), ("Q5_K_M", "Q5_K"),
                        ("Q5_K_S", "Q5_K"), ("Q4_K_M", "Q4_K"), ("Q4_K_S", "Q4_K")):  # fmt: skip
    register(FileType(_name, _default, _k_rules(_name)))
register(FileType("MXFP4_MOE", "MXFP4", _mxfp4_moe))


def get_file_type(name: str) -> FileType:
    try:
        return FILE_TYPES[name.strip().upper()]
    except KeyError:
        raise ConfigError(
            f"unknown GGUF quant type {name!r}", f"use one of: {', '.join(FILE_TYPES)}"
        ) from None


def tensor_types(tensors: list[Tensor], ftype: FileType, n_layer: int, n_expert: int) -> list[str]:
    """The ggml type of each tensor (in layer order, as llama-quantize walks them)."""
    tied = not any(t.category == "output" for t in tensors)
    n_wv = sum(t.category in ATTN_V for t in tensors)
    ctx = Context(n_layer=n_layer, n_expert=n_expert, n_attention_wv=n_wv, tied=tied)
    return [ftype.tensor_type(t, ctx) for t in tensors]
