"""A random block-FP8 checkpoint of a Qwen3-MoE shape, written directly in the published layout.

Never the float model and never a bf16 copy on disk: each decoder layer's weights are drawn
in chunks of experts, quantised with `engine.stored.BlockFP8.quantize` (128x128 blocks as
Qwen3-*-FP8 / DeepSeek ship them; the smoke shape uses smaller blocks) and stored per expert
(`mlp.experts.<e>.gate_proj.weight` float8_e4m3fn + `.weight_scale_inv` fp32); the attention
Linears FP8 too, as those repos do; embeddings, lm_head, norms and the router bf16. Shards of
~`shard_bytes` with `model.safetensors.index.json`, each shard's pages dropped once written.
The demo tokenizer goes beside it (token ids stay below the config's vocab), so `moetune
train` can read the directory as it reads a hub download.

A helper of benchmarks/stored_offload.py (not a benchmark itself).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import bench_env
import torch

CHUNK = 16  # experts drawn and quantised at once (16 x 768 x 2048 fp32 = 96 MiB)


def _uniform(shape: tuple[int, ...], gen: torch.Generator, std: float) -> torch.Tensor:
    bound = std * 3**0.5
    return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen)


def _fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    # lazy: moetune's engine imports transformers
    from moetune.engine.stored.fp8 import BlockFP8

    bufs = BlockFP8.quantize(w, block=block)
    return bufs["weight"], bufs["scale_inv"]


def layer_tensors(cfg: dict[str, Any], i: int, gen: torch.Generator,
                  block: tuple[int, int]) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """One decoder layer's tensors as an FP8 repo stores them, a chunk of experts at a time."""
    names = ("hidden_size", "moe_intermediate_size", "num_attention_heads",
             "num_key_value_heads", "head_dim", "num_experts")  # fmt: skip
    h, inter, heads, kv, hd, experts = (cfg[k] for k in names)
    p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
    attn = {"q_proj": (heads * hd, h), "k_proj": (kv * hd, h), "v_proj": (kv * hd, h),
            "o_proj": (h, heads * hd)}  # fmt: skip
    for name, shape in attn.items():
        q, s = _fp8(_uniform((1, *shape), gen, 0.02), block)
        yield f"{a}.{name}.weight", q[0].clone()
        yield f"{a}.{name}.weight_scale_inv", s[0].clone()
    yield f"{p}.mlp.gate.weight", _uniform((experts, h), gen, 0.02).to(torch.bfloat16)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        yield f"{p}.{norm}.weight", torch.ones(h, dtype=torch.bfloat16)
    yield f"{a}.q_norm.weight", torch.ones(hd, dtype=torch.bfloat16)
    yield f"{a}.k_norm.weight", torch.ones(hd, dtype=torch.bfloat16)
    projections = {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    for start in range(0, experts, CHUNK):
        n = min(CHUNK, experts - start)
        for proj, shape in projections.items():
            q, s = _fp8(_uniform((n, *shape), gen, 0.02), block)
            for j in range(n):
                key = f"{p}.mlp.experts.{start + j}.{proj}"
                yield f"{key}.weight", q[j].clone()  # safetensors refuses shared storage
                yield f"{key}.weight_scale_inv", s[j].clone()


def _edges(cfg: dict[str, Any], gen: torch.Generator) -> Iterator[tuple[str, torch.Tensor]]:
    v, h = cfg["vocab_size"], cfg["hidden_size"]
    yield "model.embed_tokens.weight", _uniform((v, h), gen, 0.02).to(torch.bfloat16)
    yield "lm_head.weight", _uniform((v, h), gen, 0.02).to(torch.bfloat16)
    yield "model.norm.weight", torch.ones(h, dtype=torch.bfloat16)


def full_config(cfg: dict[str, Any], block: tuple[int, int]) -> dict[str, Any]:
    """config.json: the shape, the demo tokenizer's special ids, the FP8 quantization_config."""
    from moetune.engine.stored.fp8 import BlockFP8

    return {**cfg, "architectures": ["Qwen3MoeForCausalLM"],
            "quantization_config": BlockFP8.config(block=block)}  # fmt: skip


def write_fp8_checkpoint(
    out: Path, cfg: dict[str, Any], *, block: tuple[int, int] = (128, 128),
    shard_bytes: int = 4 * 10**9, progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """config.json + tokenizer + FP8 shards under `out`; returns bytes, seconds, params/s."""
    from moetune.demo.tokenizer import build_tokenizer
    from moetune.engine.stored.write import Shards

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    tok = build_tokenizer()
    assert len(tok) <= cfg["vocab_size"], "the demo tokenizer's ids must fit the vocab"
    tok.save_pretrained(out)
    cfg = {**cfg, "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
           "bos_token_id": tok.bos_token_id}  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    shards = Shards(out, shard_bytes, bench_env.drop_cache)
    started, params = time.perf_counter(), 0
    for key, t in _edges(cfg, gen):
        shards.add(key, t)
        params += t.numel()
    layers = cfg["num_hidden_layers"]
    for i in range(layers):
        for key, t in layer_tensors(cfg, i, gen, block):
            shards.add(key, t)
            params += 0 if key.endswith("_scale_inv") else t.numel()
        if progress:
            took = time.perf_counter() - started
            progress(f"  layer {i + 1}/{layers}: {shards.total / 1e9:.1f} GB in {took:.0f} s "
                     f"({params / took / 1e6:.0f} M params/s)")  # fmt: skip
    total = shards.close()
    # config.json last: its presence with the index marks a complete checkpoint (see `reused`)
    (out / "config.json").write_text(json.dumps(full_config(cfg, block), indent=1))
    seconds = time.perf_counter() - started
    return {"bytes": total, "params": params, "write_s": round(seconds, 3),
            "params_per_s": round(params / seconds)}  # fmt: skip


def reused(out: Path, cfg: dict[str, Any], block: tuple[int, int]) -> int:
    """The bytes of a complete checkpoint of this shape already in `out` (0: none)."""
    index, config = out / "model.safetensors.index.json", out / "config.json"
    if not (index.is_file() and config.is_file()):
        return 0
    have = json.loads(config.read_text())
    want = full_config(cfg, block)
    if any(have.get(k) != v for k, v in want.items()):
        return 0
    return int(json.loads(index.read_text())["metadata"]["total_size"])
