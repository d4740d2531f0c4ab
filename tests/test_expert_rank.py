"""lora.expert_rank: expert stacks at their own rank, the rest of the adapter at lora.rank.

peft gets it as rank_pattern / alpha_pattern keyed by the expert target_parameters (the
same alpha/r scale everywhere); the planner's layout, the analytic estimate, the trace and
a real peft model agree on the trainable count; split LoRA trains it like peft does and
the adapter reloads in stock peft.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from peft import PeftModel, get_peft_model
from peft.tuners.lora.layer import ParamWrapper

from moetune.config import LoraArgs, RunConfig, parse_config
from moetune.engine import apply_split_lora
from moetune.errors import RecipeError
from moetune.model import ModelSpec, build_model, load_spec, spec_from_config
from moetune.model.tiny import tiny_config
from moetune.plan import layout as layout_mod
from moetune.plan.analytic import estimate
from moetune.plan.fit import analytic
from moetune.plan.layout import adapter_layout, formula_layout
from moetune.recipe.mlx import make_mlx_recipe
from moetune.recipe.targets import apply_peft, build_peft_config, make_recipe
from test_engine_experts_lora import _config, _ids, _randomize_b, _rel, _step
from test_train_helpers import one_thread, reverse_rows, run_config, save_tiny_model, write_jsonl

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ALL = ["attention", "experts", "dense", "shared"]
PATTERN_MISS = "keys did not match any targeted module"


def _spec(variant: str = "qwen2_moe-shared-dense0") -> ModelSpec:
    return spec_from_config(tiny_config(variant), variant)


def _cfg(**lora: Any) -> RunConfig:
    return parse_config({"lora": lora, "train": {"seq_len": 64}})


def _formula(spec: ModelSpec, r: int, er: int, targets: list[str]) -> int:
    """LoRA parameters by hand: r·(in + out) per Linear, er·E·(in + out) per expert stack."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_kv_heads * d
    glu = 3 * (h + spec.dense_intermediate_size)  # gate, up, down: each in + out = h + I
    shared = 3 * (h + spec.shared_intermediate_size)
    inter = spec.expert_intermediate_size
    stacks = spec.num_experts * ((h + 2 * inter) + (inter + h))  # gate_up, down
    total = 0
    for i in range(spec.num_layers):
        moe = i in spec.moe_layers
        total += r * 2 * ((h + q) + (h + kv)) if "attention" in targets else 0
        total += er * stacks if moe and "experts" in targets else 0
        total += r * shared if moe and "shared" in targets else 0
        total += r * glu if not moe and "dense" in targets else 0
    return total


def test_peft_config_gives_expert_stacks_their_rank_and_alpha() -> None:
    spec = _spec()
    config = build_peft_config(spec, LoraArgs(rank=8, expert_rank=2, targets=ALL))
    assert (config.r, config.lora_alpha) == (8, 16)
    assert config.rank_pattern == dict.fromkeys(EXPERTS, 2)
    assert config.alpha_pattern == dict.fromkeys(EXPERTS, 4)  # alpha/r = 2 for both
    for same in (LoraArgs(rank=8), LoraArgs(rank=8, expert_rank=8)):
        plain = build_peft_config(spec, same)
        assert plain.rank_pattern == {} and plain.alpha_pattern == {}


def test_peft_wraps_experts_at_expert_rank_and_the_rest_at_rank() -> None:
    spec, lora = _spec(), LoraArgs(rank=8, expert_rank=2, alpha=24, targets=ALL)
    model, _ = apply_peft(build_model(spec, device="meta"), build_peft_config(spec, lora))
    seen: dict[str, set[tuple[int, float]]] = {}
    for name, module in model.named_modules():
        if hasattr(module, "r") and "layers.1." in name:
            kind = "experts" if isinstance(module, ParamWrapper) else "linear"
            seen.setdefault(kind, set()).add((module.r["default"], module.scaling["default"]))
    assert seen == {"experts": {(2, 3.0)}, "linear": {(8, 3.0)}}
    a = model.get_submodule("base_model.model.model.layers.1.mlp.experts").lora_A["default"]
    assert a.weight.shape == (2 * spec.num_experts, spec.expert_intermediate_size)  # down_proj


def test_trainable_count_agrees_everywhere() -> None:
    """Formula = real peft model = layout (peft and formula) = analytic = trace."""
    from moetune.plan.trace.cache import run_trace

    spec, cfg = _spec(), _cfg(rank=8, expert_rank=2, targets=ALL, engine="peft")
    want = _formula(spec, 8, 2, ALL)
    assert want == 624 * 8 + 448 * 2 == 5888  # attention+dense+shared 624 r, experts 448 er
    wrapped, _ = apply_peft(build_model(spec, device="meta"), build_peft_config(spec, cfg.lora))
    assert sum(p.numel() for p in wrapped.parameters() if p.requires_grad) == want
    assert adapter_layout(spec, cfg.lora).trainable_params == want
    assert formula_layout(spec, cfg.lora).trainable_params == want
    assert analytic(spec, cfg).trainable_params == estimate(spec, cfg).trainable_params == want
    assert run_trace(spec, cfg).trainable_params == want
    uniform = _cfg(rank=8, targets=ALL)
    assert analytic(spec, uniform).trainable_params == _formula(spec, 8, 8, ALL) == 8576
    split = _cfg(rank=16, expert_rank=8, targets=ALL, engine="moetune")  # the split-LoRA step
    assert run_trace(spec, split).trainable_params == _formula(spec, 16, 8, ALL) == 13568


def test_layout_scales_experts_by_expert_rank_from_one_cached_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = _spec("qwen3_moe-dense0")
    builds: list[int] = []
    real = layout_mod.peft_layout
    monkeypatch.setattr(layout_mod, "_CACHE", {})
    monkeypatch.setattr(layout_mod, "peft_layout", lambda *a: builds.append(1) or real(*a))
    targets = ["attention", "experts", "dense"]
    for r, er in ((8, 2), (16, 4), (4, 4), (4, 16)):
        lay = adapter_layout(spec, LoraArgs(rank=r, expert_rank=er, targets=targets))
        assert lay.trainable_params == _formula(spec, r, er, targets)
        assert (lay.rank, lay.expert_rank) == (r, er)
        ranks = {(a.kind, a.rank) for layer in lay.layers for a in layer}
        assert ranks == {("attention", r), ("dense", r), ("experts", er)}
    assert len(builds) == 1  # every (rank, expert_rank) from one meta build
    halved = lay.at_rank(2)  # no expert rank given: the expert/rank ratio is kept
    assert (halved.rank, halved.expert_rank) == (2, 8)


def test_qwen3_30b_a3b_rank_16_experts_4() -> None:
    spec = load_spec("Qwen/Qwen3-30B-A3B")
    cfg = _cfg(rank=16, expert_rank=4, targets=["attention", "experts"])
    # per layer: attention 16·(2·(2048+4096) + 2·(2048+512)) = 278,528; experts
    # 4·128·((2048+1536) + (768+2048)) = 3,276,800; × 48 layers
    assert _formula(spec, 16, 4, ["attention", "experts"]) == 170_655_744
    assert adapter_layout(spec, cfg.lora).trainable_params == 170_655_744
    assert formula_layout(spec, cfg.lora).trainable_params == 170_655_744
    small = analytic(spec, cfg)
    assert small.trainable_params == 170_655_744
    full = analytic(spec, _cfg(rank=16, targets=["attention", "experts"]))
    assert full.trainable_params == 642_514_944  # docs/knowledge.md §3: unchanged without it
    # fp32 adapter weights and two Adam moments (steady state) for each trainable parameter
    assert small.components["trainable_weights"] == 4 * 170_655_744
    assert small.components["optimizer_state"] == 8 * 170_655_744
    # ~16 B per parameter saved (layer 0's gradients are not yet made at the peak)
    assert full.peak_bytes - small.peak_bytes >= 15 * (642_514_944 - 170_655_744)


def test_automap_with_expert_rank_is_a_recipe_error() -> None:
    spec, cfg = _spec(), _cfg(rank=8, expert_rank=2, expert_mapping="automap")
    for build in (build_peft_config, adapter_layout):
        with pytest.raises(RecipeError, match="expert_rank=2 needs explicit") as err:
            build(spec, cfg.lora)
        assert "lora.expert_mapping: explicit" in err.value.fix
    with pytest.raises(RecipeError):
        analytic(spec, cfg)
    assert build_peft_config(spec, _cfg(rank=8, expert_mapping="automap").lora).r == 8


def test_mlx_refuses_an_expert_rank_it_cannot_express() -> None:
    spec = _spec("qwen3_moe-dense0")
    with pytest.raises(RecipeError, match="applies to every key") as err:
        make_mlx_recipe(spec, LoraArgs(stack="mlx", rank=8, expert_rank=2))
    assert "lora.stack=peft" in err.value.fix
    same = make_mlx_recipe(spec, LoraArgs(stack="mlx", rank=8, expert_rank=8))
    assert same["config"]["lora_parameters"]["rank"] == 8


def test_false_peft_pattern_warning_is_dropped_and_real_ones_kept() -> None:
    spec = _spec("qwen3_moe-dense0")
    lora = LoraArgs(rank=8, expert_rank=2, targets=["attention", "experts", "dense"])
    config = build_peft_config(spec, lora)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_peft_model(build_model(spec, device="meta"), copy.deepcopy(config))
    raw = [str(w.message) for w in caught if PATTERN_MISS in str(w.message)]
    assert len(raw) == 2  # peft still warns (rank_pattern, alpha_pattern): the filter matters
    recipe = make_recipe(spec, lora)
    assert recipe.coverage.ranks == {"attention": (8,), "experts": (2,), "dense": (8,)}
    assert not any(PATTERN_MISS in n for n in recipe.peft_warnings)
    assert "rank_pattern={'mlp.experts.gate_up_proj': 2" in recipe.snippet
    config.rank_pattern["no_such_module"] = 3  # a real miss stays a note
    _, notes = apply_peft(build_model(spec, device="meta"), config)
    assert [n for n in notes if PATTERN_MISS in n] == [
        "The following rank_pattern keys did not match any targeted module and were ignored: "
        "['mlp.experts.down_proj', 'mlp.experts.gate_up_proj', 'no_such_module']."
    ]


def test_split_lora_at_expert_rank_matches_peft_and_reloads_in_stock_peft(
    tmp_path: Path,
) -> None:
    variant = "qwen3_moe-dense0"
    lora = LoraArgs(rank=4, expert_rank=2, targets=["attention", "experts"])
    config = build_peft_config(_spec(variant), lora)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = transformers.AutoModelForCausalLM.from_config(_config(variant))
        stock = get_peft_model(base, config)
    _randomize_b(stock)
    split = copy.deepcopy(stock)
    assert len(apply_split_lora(split)) == 4  # 2 MoE layers × gate_up, down
    ids = _ids()
    (loss_ref, grads_ref), (loss, grads) = _step(stock, ids), _step(split, ids)
    assert abs(loss.item() - loss_ref.item()) <= 1e-5
    assert all(_rel(grads[n], grads_ref[n]) <= 1e-5 for n in grads_ref)
    torch.optim.SGD([p for p in split.parameters() if p.requires_grad], lr=0.1).step()
    split.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["rank_pattern"] == dict.fromkeys(EXPERTS, 2) and saved["r"] == 4
    torch.manual_seed(0)  # the same random base
    base = transformers.AutoModelForCausalLM.from_config(_config(variant))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = PeftModel.from_pretrained(base, tmp_path)
    experts = loaded.get_submodule("base_model.model.model.layers.1.mlp.experts")
    assert experts.r["default"] == 2
    with torch.no_grad():
        assert _rel(split(input_ids=ids).logits, loaded(input_ids=ids).logits) <= 1e-5


def test_training_with_both_engines_at_expert_rank_gives_the_same_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import moetune.engine
    from moetune.train import train

    model_dir = save_tiny_model(tmp_path / "model")
    data = write_jsonl(tmp_path / "d.jsonl", reverse_rows(16))
    split_ranks: list[int] = []

    def spy(model: torch.nn.Module, **kwargs: Any) -> Any:
        switched = apply_split_lora(model, **kwargs)
        split_ranks.extend(model.get_submodule(name).r["default"] for name in switched)
        return switched

    monkeypatch.setattr(moetune.engine, "apply_split_lora", spy)
    results = {}
    for engine in ("peft", "moetune"):
        cfg = run_config(model_dir, data, tmp_path / engine, lora__engine=engine,
                         lora__expert_rank=2, lora__targets=["attention", "experts"])  # fmt: skip
        with one_thread():
            results[engine] = train(cfg, progress=False)
    assert split_ranks == [2] * 4  # engine moetune ran split LoRA on 2 layers × 2 stacks
    peft_run, ours = results["peft"], results["moetune"]
    assert ours.coverage == 1.0 and ours.steps == peft_run.steps == 6
    assert ours.final_loss is not None and peft_run.final_loss is not None
    assert abs(ours.final_loss - peft_run.final_loss) <= 1e-5
    ids = _ids(vocab=40)
    logits = {}
    for engine, result in results.items():
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        loaded = PeftModel.from_pretrained(base, result.adapter_dir)
        assert loaded.get_submodule("base_model.model.model.layers.0.mlp.experts").r == {
            "default": 2
        }
        with torch.no_grad():
            logits[engine] = loaded(input_ids=ids).logits
    assert _rel(logits["moetune"], logits["peft"]) <= 1e-4
