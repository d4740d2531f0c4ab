"""serve-plan: GGUF and vLLM byte figures checked against arithmetic from config.json
fields, the smallest --n-cpu-moe, unified memory, the TP degree, bad input as one line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moetune.cli import app
from moetune.errors import ConfigError, UnknownCardError
from moetune.model import load_spec
from moetune.model.spec import ModelSpec
from moetune.plan.hardware import get_card
from moetune.plan.serve.engines import (
    compute_buffer_bytes,
    gguf_tensor_bytes,
    inventory,
    kv_cache_bytes,
    plan_llama_cpp,
    serve_plans,
)
from moetune.plan.serve.gguf import get_file_type, use_more_bits
from moetune.plan.serve.vllm import CUDA_GRAPHS, activation_bytes, plan_vllm

Q4_K, Q6_K, Q8_0 = 144 / 256, 210 / 256, 34 / 32  # bytes per weight (ggml block sizes)
# Qwen3-30B-A3B's config.json, by hand
L, H, HEADS, KV, D, E, INTER, V = 48, 2048, 32, 4, 128, 128, 768, 151_936


@pytest.fixture(scope="module")
def qwen30b() -> ModelSpec:
    return load_spec("Qwen/Qwen3-30B-A3B")


def _more_bits_layers() -> int:
    # llama.cpp's use_more_bits: first and last eighth, and every third layer between
    return sum(1 for i in range(L) if i < L // 8 or i >= 7 * L // 8 or (i - L // 8) % 3 == 2)


def test_use_more_bits_matches_llama_cpp() -> None:
    chosen = [i for i in range(48) if use_more_bits(i, 48)]
    assert chosen[:8] == [0, 1, 2, 3, 4, 5, 8, 11] and chosen[-6:] == [42, 43, 44, 45, 46, 47]
    assert len(chosen) == _more_bits_layers() == 24


def test_q4_k_m_bytes_of_qwen3_30b_by_hand(qwen30b: ModelSpec) -> None:
    more = _more_bits_layers()
    q, k, v, o = H * HEADS * D, H * KV * D, H * KV * D, HEADS * D * H
    gate_up, down = 2 * E * INTER * H, E * H * INTER
    per_layer_q4 = (q + k + o + gate_up) * Q4_K
    weights = (
        L * per_layer_q4
        + more * (v + down) * Q6_K  # attn_v and ffn_down (experts) in use_more_bits layers
        + (L - more) * (v + down) * Q4_K
        + V * H * Q4_K  # token_embd: the default type
        + V * H * Q6_K  # output: Q6_K
        + 4 * (L * (E * H + 2 * D + 2 * H) + H)  # F32: routers, q/k norms, layer norms, final
    )
    rows = gguf_tensor_bytes(qwen30b, "Q4_K_M")
    assert sum(b for *_, b in rows) == pytest.approx(weights, abs=len(rows))
    assert 18.4e9 < weights < 18.7e9  # the published Qwen3-30B-A3B-Q4_K_M.gguf is 18.6 GB
    by_type = {t: sum(1 for _, ty, _ in rows if ty == t) for t in ("Q4_K", "Q6_K", "F32")}
    assert by_type["Q6_K"] == 2 * more + 1  # attn_v + ffn_down_exps in 24 layers, output


def test_uniform_types_and_bf16_equal_params_times_bytes(qwen30b: ModelSpec) -> None:
    f32 = 4 * (L * (E * H + 2 * D + 2 * H) + H)
    f32_params = f32 // 4
    bf16 = sum(b for *_, b in gguf_tensor_bytes(qwen30b, "BF16"))
    assert bf16 == 2 * (qwen30b.total_params - f32_params) + f32
    q8 = sum(b for *_, b in gguf_tensor_bytes(qwen30b, "Q8_0"))
    assert q8 == pytest.approx((qwen30b.total_params - f32_params) * Q8_0 + f32, abs=2000)
    with pytest.raises(ConfigError, match="unknown GGUF quant type"):
        get_file_type("Q4_K_X")


def test_kv_cache_of_attention_layers_by_hand(qwen30b: ModelSpec) -> None:
    plan = plan_llama_cpp(qwen30b, "H200", "Q4_K_M", ctx=32768)
    assert plan.kv_cache_bytes == L * 2 * KV * D * 32768 * 2  # K and V, f16
    q8 = plan_llama_cpp(qwen30b, "H200", "Q4_K_M", ctx=32768, kv_type="q8_0")
    assert q8.kv_cache_bytes == int(L * 2 * KV * D * 32768 * Q8_0)


def test_mla_and_linear_attention_caches() -> None:
    ds = load_spec("deepseek-ai/DeepSeek-V3")
    # MLA: the compressed latent (kv_lora_rank 512 + rope 64) per token, 61 layers
    assert kv_cache_bytes(inventory(ds), 4096, 2.0) == 61 * (512 + 64) * 4096 * 2
    nxt = load_spec("Qwen/Qwen3-Next-80B-A3B-Instruct")
    inv = inventory(nxt)
    # 12 full-attention layers (2 KV heads × 256) grow with the context; 36 DeltaNet layers
    # hold a fixed fp32 state: 32 heads × 128 × 128, and a 3-step conv of q, k, v
    state = 4 * (32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128))
    for tokens in (1024, 65536):
        assert kv_cache_bytes(inv, tokens, 2.0) == 36 * state + 12 * 2 * 2 * 256 * tokens * 2


def test_sliding_window_layers_cache_the_window() -> None:
    oss = load_spec("openai/gpt-oss-20b")  # 24 layers, half sliding (window 128), 8 KV × 64
    inv = inventory(oss)
    full = kv_cache_bytes(inv, 32768, 2.0, extra=512)
    assert full == 12 * 2 * 8 * 64 * 2 * (32768 + 128 + 512)


def _gpu_bytes(rows: list, usable_n: int, plan_components: dict) -> int:  # type: ignore[type-arg]
    experts = sum(b for t, _, b in rows if t.routed and t.layer is not None and t.layer < usable_n)
    embd = sum(b for t, _, b in rows if t.category == "token_embd")
    fixed = sum(v for k, v in plan_components.items() if k != "weights")
    return sum(b for *_, b in rows) - embd - experts + fixed


def test_n_cpu_moe_is_the_smallest_that_fits(qwen30b: ModelSpec) -> None:
    card = get_card("RTX-4090")
    plan = plan_llama_cpp(qwen30b, card, "Q8_0", ctx=32768)
    n = plan.n_cpu_moe
    assert plan.fits and n is not None and 0 < n < L
    rows = gguf_tensor_bytes(qwen30b, "Q8_0")
    needs = [_gpu_bytes(rows, k, plan.components) for k in range(L + 1)]
    assert needs == sorted(needs, reverse=True)  # each offloaded layer frees its experts
    assert needs[n] <= card.usable_bytes < needs[n - 1]
    assert plan.required_bytes == needs[n]
    per_layer = E * 3 * H * INTER * Q8_0
    embd = V * H * Q8_0
    assert plan.cpu_ram_bytes == pytest.approx(n * per_layer + embd, rel=1e-6)
    # a longer context needs at least as many layers' experts in RAM
    longer = [plan_llama_cpp(qwen30b, card, "Q8_0", ctx=c).n_cpu_moe for c in (4096, 32768, 131072)]
    assert longer == sorted(longer) and longer[0] < longer[-1]  # type: ignore[type-var]
    small = plan_llama_cpp(qwen30b, "H200", "Q8_0")
    assert small.n_cpu_moe == 0 and small.cpu_ram_bytes == int(embd)


def test_unified_memory_offloads_nothing(qwen30b: ModelSpec) -> None:
    plan = plan_llama_cpp(qwen30b, "DGX-Spark", "BF16", ctx=32768)
    assert plan.n_cpu_moe == 0 and plan.cpu_ram_bytes == 0
    assert plan.components["weights"] == plan.weights_bytes  # everything on the GPU
    assert any("frees nothing" in n and "-ngl 99" in n for n in plan.notes)
    mac = plan_llama_cpp(load_spec("deepseek-ai/DeepSeek-V3"), "M3-Max-128GB", "Q4_K_M")
    assert not mac.fits and mac.n_cpu_moe == 0  # offloading cannot rescue it either


def test_vllm_weights_lora_and_kv_by_hand(qwen30b: ModelSpec) -> None:
    plan = plan_vllm(qwen30b, "H200", max_model_len=32768, max_loras=1, max_lora_rank=16)
    assert plan.tensor_parallel == 1 and plan.fits
    assert plan.weights_bytes == 2 * qwen30b.total_params  # bf16 checkpoint
    assert plan.kv_cache_bytes == L * 2 * KV * D * 32768 * 2
    attention = 16 * ((H + HEADS * D) + 2 * (H + KV * D) + (HEADS * D + H))
    experts = E * 16 * (3 * H + 3 * INTER)  # w13 A (2·H), w13 B (2·INTER), w2 A (INTER), w2 B (H)
    assert plan.components["lora_buffers"] == 2 * L * (attention + experts)
    assert plan.budget_bytes == int(0.9 * get_card("H200").usable_bytes)
    off = plan_vllm(qwen30b, "H200", max_loras=0)
    assert off.components["lora_buffers"] == 0
    assert off.components["activations"] == activation_bytes(qwen30b, 1)
    assert off.components["cuda_graphs"] == CUDA_GRAPHS


def test_vllm_tensor_parallel_degree_is_the_smallest_that_fits() -> None:
    spec = load_spec("Qwen/Qwen3-235B-A22B")
    for card, expected in (("H100-80GB", 8), ("H200", 4)):
        plan = plan_vllm(spec, card, max_model_len=32768)
        assert plan.tensor_parallel == expected and plan.fits
        smaller = plan_vllm(spec, card, max_model_len=32768, tensor_parallel=expected // 2)
        assert not smaller.fits
    norms_routers = 94 * (2 * 4096 + 2 * 128 + 128 * 4096) + 4096
    plan = plan_vllm(spec, "H200", tensor_parallel=4)
    sharded = 2 * (spec.total_params - norms_routers)
    assert plan.weights_bytes == -(-sharded // 4) + 2 * norms_routers
    # 4 KV heads: TP 8 holds one head per rank (replicated pairs), not half a head
    tp8 = plan_vllm(spec, "H100-80GB", max_model_len=32768, tensor_parallel=8)
    assert tp8.kv_cache_bytes == 94 * 2 * 1 * 128 * 32768 * 2
    with pytest.raises(ConfigError, match="does not divide"):
        plan_vllm(spec, "H200", tensor_parallel=3)


def test_compute_buffer_and_plan_json_fields(qwen30b: ModelSpec) -> None:
    plans = serve_plans(qwen30b, ["H200"], "llama.cpp", quant="Q4_K_M", max_loras=3)
    data = plans["H200"].to_json()
    for key in ("weights_bytes", "kv_cache_bytes", "n_cpu_moe", "fits", "cpu_ram_bytes"):
        assert key in data
    assert data["components"]["compute_buffer"] == compute_buffer_bytes(qwen30b)
    assert data["required_bytes"] == sum(data["components"].values())
    with pytest.raises(UnknownCardError):
        serve_plans(qwen30b, ["H900"], "vllm")
    with pytest.raises(ConfigError, match="unknown serving engine"):
        serve_plans(qwen30b, ["H200"], "sglang")


def test_cli_serve_plan_json_and_one_line_errors() -> None:
    runner = CliRunner()
    base = ["serve-plan", "Qwen/Qwen3-30B-A3B", "--card", "RTX-4090", "--card", "DGX-Spark"]
    ok = runner.invoke(app, [*base, "--engine", "llama.cpp", "--quant", "Q8_0", "--json"])
    assert ok.exit_code == 0, ok.stderr
    cards = json.loads(ok.stdout)["cards"]
    assert cards["RTX-4090"]["n_cpu_moe"] > 0 and cards["DGX-Spark"]["n_cpu_moe"] == 0
    vllm = runner.invoke(app, [*base, "--engine", "vllm", "--json"])
    assert json.loads(vllm.stdout)["cards"]["RTX-4090"]["tensor_parallel"] == 4
    gguf = ["serve-plan", "Qwen3-30B-A3B-Q4_K_M.gguf", "--engine", "llama.cpp"]
    for bad in (["--engine", "sglang"], ["--engine", "vllm", "--card", "H900"], gguf):
        result = runner.invoke(app, bad if bad is gguf else [*base, *bad])
        assert result.exit_code == 2
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_cli_serve_plan_refuses_a_rank_vllm_refuses_and_prints_every_choice() -> None:
    runner = CliRunner()
    base = ["serve-plan", "Qwen/Qwen3-30B-A3B", "--card", "H200", "--engine", "vllm"]
    bad = runner.invoke(app, [*base, "--max-lora-rank", "3"])
    assert bad.exit_code == 2 and "--max-lora-rank 3 is not a rank vLLM accepts" in bad.stderr
    assert "1, 8, 16, 32, 64" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    ok = runner.invoke(app, [*base, "--max-lora-rank", "64", "--max-loras", "2", "--json"])
    notes = json.loads(ok.stdout)["cards"]["H200"]["notes"]
    line = next(n for n in notes if n.startswith("vllm serve"))
    assert "--max-lora-rank 64" in line and "--max-loras 2" in line and "--enable-lora" in line
    assert "--max-model-len 32768" in line
