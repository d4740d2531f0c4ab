"""peft recipes: explicit targets reach 100 % of what was asked, automap provably does not,
the counts match the published Qwen3-30B-A3B numbers, and adapters round-trip."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from moetune.config import LoraArgs
from moetune.errors import RecipeError
from moetune.model import ModelSpec, build_model, load_spec, spec_from_config
from moetune.model.tiny import TINY_CONFIGS, tiny_config
from moetune.recipe import recipe_for
from moetune.recipe.audit import CoverageReport, audit_coverage
from moetune.recipe.targets import (
    PEFT_DROPOUT_ERROR,
    apply_peft,
    build_peft_config,
    make_recipe,
    peft_name_map,
)

ALL = ["attention", "experts", "dense", "shared"]
# (variant, expected adapted == expected targets per kind); absent kinds are "not present".
# Counts are layers × paths, e.g. qwen2_moe: 3 layers × q/k/v/o, 2 MoE layers × 2 fused
# params, 1 dense layer × gate/up/down, 2 MoE layers × shared gate/up/down.
EXPECTED = {
    "qwen3_moe-dense0": {"attention": 12, "experts": 4, "dense": 3},
    "qwen2_moe-shared-dense0": {"attention": 12, "experts": 4, "dense": 3, "shared": 6},
    "olmoe": {"attention": 12, "experts": 6},
    "mixtral": {"attention": 12, "experts": 6},
    # MLA with q_lora_rank: q_a, q_b, kv_a_proj_with_mqa, kv_b, o; layer 0 dense
    "deepseek_v3": {"attention": 15, "experts": 4, "dense": 3, "shared": 6},
    "gpt_oss": {"attention": 12, "experts": 6},
}
MOE_VARIANTS = [v for v in TINY_CONFIGS if spec_from_config(tiny_config(v), v).is_moe]
# MLA repeats k/v per query head: a real forward needs num_key_value_heads == heads
# (the shared tiny config has 2 of 4, which builds and counts fine but cannot run).
FORWARDABLE = {"deepseek_v3": {"num_key_value_heads": 4}}


def _spec(variant: str) -> ModelSpec:
    return spec_from_config({**tiny_config(variant), **FORWARDABLE.get(variant, {})}, variant)


def _audit(spec: ModelSpec, lora: LoraArgs) -> CoverageReport:
    wrapped, _ = apply_peft(build_model(spec, device="meta"), build_peft_config(spec, lora))
    return audit_coverage(wrapped, spec, lora)


@pytest.mark.parametrize("variant", sorted(EXPECTED))
def test_explicit_reaches_every_requested_target(variant: str) -> None:
    spec, lora = _spec(variant), LoraArgs(rank=4, targets=ALL)
    report = _audit(spec, lora)
    want = EXPECTED[variant]
    assert {k: a for k, (a, e) in report.by_kind().items() if e} == want
    assert {k: e for k, (a, e) in report.by_kind().items() if e} == want
    assert report.coverage == 1.0 and not report.missed and not report.unresolved
    assert set(report.absent) == set(ALL) - set(want)
    assert not report.router_adapted and set(report.router.values()) == {"frozen"}
    assert report.ranks == {kind: (4,) for kind in want}  # rank r everywhere, no doubling
    assert build_peft_config(spec, lora).lora_dropout == 0.0


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_every_moe_family_is_fully_covered(variant: str) -> None:
    report = make_recipe(_spec(variant), LoraArgs(rank=2)).coverage
    assert report.coverage == 1.0 and report.expected > 0
    assert not report.unresolved, f"family paths found nowhere: {report.unresolved}"
    assert not report.router_adapted


def test_tiny_trainable_count_is_exact() -> None:
    # qwen3_moe-dense0, r=4: attention 3 × 4·(16+32 + 16+16 + 16+16 + 32+16) = 1920;
    # experts 2 × 4·4·((16+16) + (8+16)) = 1792; dense layer 0: 4·3·(16+24) = 480
    recipe = make_recipe(_spec("qwen3_moe-dense0"), LoraArgs(rank=4))
    assert recipe.trainable_params == 1920 + 1792 + 480


def test_qwen3_30b_counts_match_published_numbers() -> None:
    spec = load_spec("Qwen/Qwen3-30B-A3B")
    explicit = make_recipe(spec, LoraArgs(rank=16, targets=["attention", "experts"]))
    assert explicit.trainable_params == 642_514_944
    assert round(100 * explicit.trainable_fraction, 2) == 2.06
    assert explicit.coverage.by_kind() == {"attention": (192, 192), "experts": (96, 96)}
    automap = make_recipe(
        spec, LoraArgs(rank=16, targets=["attention", "experts"], expert_mapping="automap")
    )
    assert automap.trainable_params == 994_836_480
    assert round(100 * automap.trainable_fraction, 2) == 3.16
    assert automap.coverage.ranks["experts"] == (16, 32)  # peft doubles gate_up_proj


@pytest.mark.parametrize(
    ("variant", "missed"),
    [
        ("deepseek_v3", {"dense": (0, 3), "shared": (0, 6)}),  # peft #3711
        ("qwen2_moe-shared-dense0", {"experts": (0, 4)}),  # no peft mapping for qwen2_moe
        ("gpt_oss", {"experts": (0, 6)}),
    ],
)
def test_automap_misses_targets_and_the_audit_says_so(
    variant: str, missed: dict[str, tuple[int, int]]
) -> None:
    spec, lora = _spec(variant), LoraArgs(rank=4, targets=ALL, expert_mapping="automap")
    report = _audit(spec, lora)
    assert report.coverage < 1.0
    assert {k: v for k, v in report.by_kind().items() if v[1] and v[0] < v[1]} == missed
    with pytest.raises(RecipeError, match=r"requested targets got LoRA.*missed") as err:
        make_recipe(spec, lora)
    assert "expert_mapping=explicit" in err.value.fix


def test_peft_rewrites_dense_names_even_as_a_regex() -> None:
    """Why dense/shared MLPs go through target_parameters: a full-path regex naming them is
    resolved to leaf names and moved onto the fused experts by peft 0.21 (trap probe)."""
    spec = _spec("deepseek_v3")
    regex = r"model\.layers\.\d+\.(self_attn\.o_proj|mlp\.(gate|up|down)_proj)"
    config = LoraConfig(r=4, target_modules=regex)
    wrapped, _ = apply_peft(build_model(spec, device="meta"), config)
    lora = LoraArgs(rank=4, targets=["dense"])
    assert _audit(spec, lora).coverage == 1.0  # moetune's recipe reaches layer 0's MLP
    assert audit_coverage(wrapped, spec, lora).by_kind() == {"dense": (0, 3)}


def test_router_adapted_only_when_asked() -> None:
    spec = _spec("qwen3_moe-dense0")
    for lora in (LoraArgs(rank=4, train_router=True), LoraArgs(rank=4, targets=["router"])):
        report = _audit(spec, lora)
        assert report.router == {1: "lora", 2: "lora"} and report.router_adapted
        assert report.by_kind()["router"] == (2, 2)


def test_audit_flags_an_unrequested_router() -> None:
    """all-linear (a common vanilla choice) puts LoRA on the router: the audit sees it."""
    spec = _spec("qwen3_moe-dense0")
    wrapped, _ = apply_peft(
        build_model(spec, device="meta"), LoraConfig(r=4, target_modules="all-linear")
    )
    report = audit_coverage(wrapped, spec, LoraArgs(rank=4, targets=["attention"]))
    assert report.coverage == 1.0 and report.router_adapted


def test_dense_model_with_experts_is_refused() -> None:
    spec = _spec("llama-biases")
    with pytest.raises(RecipeError, match="is dense: it has no experts") as err:
        build_peft_config(spec, LoraArgs())
    assert "drop 'experts'" in err.value.fix
    recipe = make_recipe(spec, LoraArgs(rank=4, targets=["attention", "dense"]))
    assert recipe.coverage.by_kind() == {"attention": (12, 12), "dense": (9, 9)}


def test_dropout_with_parameter_targets_is_refused() -> None:
    with pytest.raises(RecipeError) as err:
        build_peft_config(_spec("qwen3_moe-dense0"), LoraArgs(dropout=0.1, engine="peft"))
    assert PEFT_DROPOUT_ERROR in err.value.cause
    # deepseek dense MLPs need target_parameters too (peft would rewrite their names);
    # moetune's engine applies dropout to expert stacks only, so they are refused on both
    for engine in ("auto", "peft"):
        with pytest.raises(RecipeError, match=r"deepseek|mlp"):
            build_peft_config(
                _spec("deepseek_v3"), LoraArgs(dropout=0.1, targets=["dense"], engine=engine)
            )
    experts = LoraArgs(dropout=0.1, targets=["attention", "experts"])  # engine auto
    split = build_peft_config(_spec("deepseek_v3"), experts)
    assert split.lora_dropout == 0.0 and split.target_parameters  # applied after the build
    # qwen2_moe has no rewrite: dense and shared stay plain Linear targets, dropout is fine
    ok = build_peft_config(
        _spec("qwen2_moe-shared-dense0"), LoraArgs(dropout=0.1, targets=["dense", "shared"])
    )
    assert ok.lora_dropout == 0.1 and not ok.target_parameters


def test_peft_name_map_follows_installed_peft() -> None:
    assert set(peft_name_map("qwen3_moe")) == {"gate", "gate_proj", "up_proj", "down_proj"}
    assert set(peft_name_map("deepseek_v3")) == {"gate", "gate_proj", "up_proj", "down_proj"}
    assert set(peft_name_map("mixtral")) == {"gate", "w1", "w2", "w3"}
    assert peft_name_map("qwen2_moe") == {} and peft_name_map("gpt_oss") == {}


def test_recipe_is_json_and_its_snippet_runs() -> None:
    spec = _spec("deepseek_v3")
    payload = recipe_for(spec, LoraArgs(rank=4))
    assert json.loads(json.dumps(payload)) == payload
    cfg = payload["peft_config"]
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and cfg["lora_dropout"] == 0.0
    assert "mlp.gate_proj.weight" in cfg["target_parameters"]
    scope: dict[str, Any] = {"model": build_model(spec, device="meta")}
    exec(payload["snippet"], scope)
    trainable = sum(p.numel() for p in scope["model"].parameters() if p.requires_grad)
    assert trainable == payload["trainable_params"]


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits  # type: ignore[no-any-return]


@pytest.mark.parametrize("variant", sorted(EXPECTED))
def test_saved_adapter_reloads_with_identical_logits(variant: str, tmp_path: Path) -> None:
    spec = _spec(variant)
    torch.manual_seed(0)
    base = build_model(spec, device="cpu", dtype=torch.float32).eval()
    weights = {k: v.clone() for k, v in base.state_dict().items()}
    ids = torch.randint(3, spec.vocab_size, (2, 7))
    plain = _logits(base, ids)
    model = get_peft_model(base, build_peft_config(spec, LoraArgs(rank=4)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    tuned = _logits(model, ids)
    assert not torch.allclose(tuned, plain, atol=1e-4)  # the adapter does something
    model.save_pretrained(tmp_path)
    fresh = build_model(spec, device="cpu", dtype=torch.float32).eval()
    fresh.load_state_dict(weights)
    reloaded = PeftModel.from_pretrained(fresh, tmp_path)
    torch.testing.assert_close(_logits(reloaded, ids), tuned, atol=1e-6, rtol=0)


@pytest.mark.parametrize("variant", ["deepseek_v3", "qwen2_moe-shared-dense0"])
def test_every_adapter_trains_and_the_router_stays_frozen(variant: str) -> None:
    spec = _spec(variant)
    torch.manual_seed(0)
    base = build_model(spec, device="cpu", dtype=torch.float32)
    model = get_peft_model(base, build_peft_config(spec, LoraArgs(rank=4)))
    ids = torch.randint(3, spec.vocab_size, (2, 9))
    model(input_ids=ids, labels=ids).loss.backward()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.grad is not None for p in trainable.values())
    routers = [p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert routers and all(p.grad is None and not p.requires_grad for p in routers)


def test_a_wrong_family_path_is_missed_not_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A family table naming a module the model does not have must fail the recipe."""
    from moetune.model import derive
    from moetune.model.families import registry as families

    real = derive.derive_cached

    def wrong_paths(raw: dict, name: str = "custom") -> derive.Derived:
        found = real(raw, name)
        wrong = replace(found.paths, attention=("q_proj", "k_proj", "v_proj", "out_proj"))
        return replace(found, paths=wrong)

    monkeypatch.setattr(derive, "derive_cached", wrong_paths)
    monkeypatch.setattr(families, "derive_cached", wrong_paths)  # Family.paths_of reads it
    with pytest.raises(RecipeError, match=r"out_proj \(not in model\)") as err:
        make_recipe(_spec("olmoe"), LoraArgs(rank=4, targets=["attention"]))
    assert "module paths are wrong" in err.value.fix
    assert "9/12 requested targets" in err.value.cause
