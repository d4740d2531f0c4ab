"""Every MoE model type of the *installed* transformers, end to end on a tiny config.

The list is the library's own (model.census): a newer transformers brings its new families
in by itself. Each type gets a tiny config derived from its config class; moetune must
count it exactly, cover its expert stacks with LoRA, and trace its training step as a real
CPU step allocates it. Types that cannot be built as a decoder MoE say why in one line.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

from moetune.config import LoraArgs
from moetune.model import build_model, get_family, spec_from_config, to_hf_config
from moetune.model.census import census, moe_model_types, multimodal_model_types, shrunk_config
from moetune.model.derive import causal_lm_class
from moetune.plan.trace.fake_step import trace_step
from moetune.recipe.targets import build_peft_config, make_recipe

pytestmark = pytest.mark.filterwarnings("ignore")
MOE = moe_model_types()
MULTIMODAL = multimodal_model_types()
LORA = LoraArgs(rank=4, targets=["attention", "experts"], engine="peft")
# The families the issue names: each must be among the installed library's MoE types.
NAMED = (
    "qwen3_5_moe_text", "qwen3_next", "gemma4_text", "glm4_moe_lite", "deepseek_v32",
    "deepseek_v4", "minimax_m2", "kimi_linear", "lfm2_moe", "nemotron_h", "granitemoehybrid",
    "mistral4", "dbrx", "llama4_text", "qwen3_moe", "mixtral", "olmoe", "gpt_oss",
)  # fmt: skip
# The trace runs the step op by op on fake tensors; an op whose output shape depends on
# the data (aten.nonzero, .item() / .tolist() in an eager expert loop: longcat_flash,
# qwen4_exp_text, glm5_next_text, jetmoe, step3p5) is answered from a balanced routing
# (plan.balanced), so every type traces. A type that cannot goes here as a strict xfail
# with transformers' own cause, so that a library change that fixes it is noticed.
CANNOT_TRACE: dict[str, str] = {}


def _case(model_type: str, known: dict[str, str]) -> Any:
    """A parameter, marked as a strict xfail with its reason where `known` lists it."""
    reason = known.get(model_type)
    if reason is None:
        return model_type
    return pytest.param(model_type, marks=pytest.mark.xfail(strict=True, reason=reason))


def _spec(model_type: str):
    return spec_from_config(shrunk_config(model_type), model_type)


def _numel(model_type: str) -> int:
    """An independent count: transformers' own class, built on meta, every parameter."""
    spec = _spec(model_type)
    config = to_hf_config(spec)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = causal_lm_class(config)._from_config(config)
    return sum(p.numel() for p in model.parameters())


def test_the_census_is_the_installed_librarys() -> None:
    listed = census()
    assert len(MOE) >= 55, MOE
    missing = [t for t in NAMED if t not in MOE and t not in ("dbrx",)]
    assert not missing, {t: listed.get(t) for t in missing}
    # every type that is not a decoder MoE here says why, in one line
    for model_type, status in listed.items():
        assert status in ("moe", "multimodal") or (status and "\n" not in status), model_type
    assert "switch_transformers" in listed and listed["switch_transformers"] != "moe"
    assert "encoder" in listed["switch_transformers"]  # encoder-decoder: not fine-tunable here


@pytest.mark.parametrize("model_type", MOE)
def test_inspect_counts_every_parameter_exactly(model_type: str) -> None:
    spec = _spec(model_type)
    assert spec.is_moe and spec.num_experts >= 2 and 1 <= spec.top_k <= spec.num_experts
    assert spec.total_params == _numel(model_type)
    assert spec.components.routed_experts > 0
    assert 0 < spec.active_params < spec.total_params
    assert len(spec.mixers) == spec.num_layers


@pytest.mark.parametrize("model_type", MOE)
def test_recipe_covers_every_expert_stack(model_type: str) -> None:
    spec = _spec(model_type)
    recipe = make_recipe(spec, LORA)
    report = recipe.coverage
    assert report.coverage == 1.0
    experts = [r for r in report.rows if r.kind == "experts"]
    assert {r.layer for r in experts} == set(spec.moe_layers)
    assert all(state == "frozen" for state in report.router.values())


@pytest.mark.skipif("deepseek_v4" not in MOE, reason="no deepseek_v4 in this transformers")
def test_a_grouped_linear_peft_cannot_wrap_is_left_out_and_named() -> None:
    """DeepSeek-V4's o_a_proj is an nn.Linear whose forward is a bmm over head groups:
    peft's LoRA beside it adds a tensor of another width (32 vs 256) and the step fails.
    The recipe aims at every other attention Linear and names this one with why."""
    spec = _spec("deepseek_v4")
    recipe = make_recipe(spec, LORA)
    assert "o_a_proj" not in set(build_peft_config(spec, LORA).target_modules)
    assert "o_b_proj" in set(build_peft_config(spec, LORA).target_modules)
    assert recipe.coverage.coverage == 1.0
    why = recipe.coverage.to_json()["not_targeted"]
    assert list(why) == ["self_attn.o_a_proj"] and "grouped" in why["self_attn.o_a_proj"]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from peft import get_peft_model

        config = to_hf_config(spec)
        base = causal_lm_class(config)._from_config(config)
        model = get_peft_model(base, build_peft_config(spec, LORA))
    ids = torch.randint(0, config.vocab_size, (1, 16))
    loss = model(input_ids=ids, labels=ids).loss  # the forward peft failed in
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n and "o_b_proj" in n]
    assert torch.isfinite(loss) and grads and all(g is not None for g in grads)


@pytest.mark.parametrize("model_type", MULTIMODAL)
def test_multimodal_checkpoints_plan_their_language_model(model_type: str) -> None:
    spec = _spec(model_type)
    assert spec.is_moe and spec.model_type != model_type  # the text model inside
    assert make_recipe(spec, LORA).coverage.coverage == 1.0
    assert sum(p.numel() for p in build_model(spec).parameters()) == spec.total_params


def _trace(model_type: str, fake: bool):
    spec = _spec(model_type)
    family = get_family(spec.model_type)
    assert family.layers_prefix
    return trace_step(
        to_hf_config(spec), build_peft_config(spec, LORA), seq_len=16, loss="full",
        gradient_checkpointing=False, fake=fake,
    )  # fmt: skip


FAST_TRACE = ["qwen3_next", "nemotron_h", "mistral4", "minimax_m2", "glm4_moe_lite"]


@pytest.mark.parametrize("model_type", [t for t in FAST_TRACE if t in MOE])
def test_trace_equals_a_real_cpu_step(model_type: str) -> None:
    fake, real = _trace(model_type, True), _trace(model_type, False)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.trainable_params == real.trainable_params


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [_case(t, CANNOT_TRACE) for t in MOE])
def test_trace_equals_a_real_cpu_step_every_family(model_type: str) -> None:
    fake, real = _trace(model_type, True), _trace(model_type, False)
    assert fake.peak_bytes == real.peak_bytes


def _save_tiny(model_type: str, out):
    """A tiny random model of `model_type` saved with the demo's character tokenizer."""
    from moetune.demo.tokenizer import build_tokenizer

    tok = build_tokenizer()
    spec = _spec(model_type)
    config = to_hf_config(spec)
    for name, value in (("pad", tok.pad_token_id), ("eos", tok.eos_token_id),
                        ("bos", tok.bos_token_id)):  # fmt: skip
        setattr(config, f"{name}_token_id", value)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = causal_lm_class(config)._from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


# Families that do not train here yet, each with why (strict: a fix is noticed). deepseek_v4
# trains since its grouped o_a_proj is left out of the LoRA targets (a Linear peft can't wrap).
CANNOT_TRAIN: dict[str, str] = {}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [_case(t, CANNOT_TRAIN) for t in MOE])
def test_five_training_steps_reach_every_expert_with_the_router_unchanged(
    model_type: str, tmp_path
) -> None:
    from moetune.train.trainer import train
    from test_train_helpers import one_thread, reverse_rows, run_config, write_jsonl

    model = _save_tiny(model_type, tmp_path / "model")
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(12))
    cfg = run_config(
        model, data, tmp_path / "run", max_steps=5, save_steps=5, seq_len=16,
        gradient_checkpointing=True,
    )  # fmt: skip
    with one_thread():
        result = train(cfg, progress=False)
    assert (result.steps, result.coverage, result.router_changed) == (5, 1.0, False)
    # a class refusing checkpointing (jetmoe) trains without it, and the run says so
    refuses = not getattr(causal_lm_class(to_hf_config(_spec(model_type))),
                          "supports_gradient_checkpointing", True)  # fmt: skip
    assert refuses == any("checkpointing is off" in w for w in result.warnings)


@pytest.mark.skipif("deepseek_v32" not in MOE, reason="no deepseek_v32 in this transformers")
def test_no_lora_target_sits_where_autograd_never_reaches() -> None:
    """DeepSeek-V3.2's indexer runs under @torch.no_grad(): LoRA there is dead weight. The
    recipe leaves it out, and every LoRA tensor it does place gets a gradient."""
    from peft import get_peft_model

    from moetune.model.read import runs_without_grad

    spec = _spec("deepseek_v32")
    config = build_peft_config(spec, LORA)
    assert not {"wq_b", "wk", "weights_proj"} & set(config.target_modules)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = causal_lm_class(to_hf_config(spec))._from_config(to_hf_config(spec))
        model = get_peft_model(base, config)
    assert any(runs_without_grad(m) for m in model.modules())  # the fact the rule rests on
    for p in model.parameters():  # B starts at 0, which would zero every A's gradient
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)
    ids = torch.randint(0, to_hf_config(spec).vocab_size, (1, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    dead = [
        n for n, p in model.named_parameters()
        if p.requires_grad and (p.grad is None or not p.grad.abs().sum())
    ]  # fmt: skip
    assert dead == []


INKLING2 = [t for t in ("inkling2_text", "inkling2_loop_text") if t in MOE]


def _lora_tensors(spec: Any, config: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """A CPU build of `spec` wrapped by `config`: its base model and adapter state dict."""
    from peft import get_peft_model, get_peft_model_state_dict

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = causal_lm_class(to_hf_config(spec))._from_config(to_hf_config(spec))
        model = get_peft_model(base, copy.deepcopy(config))
    return model.get_base_model(), get_peft_model_state_dict(model)


@pytest.mark.parametrize("model_type", INKLING2)
def test_a_linear_whose_adapter_keys_peft_renames_is_left_out_and_named(model_type: str) -> None:
    """transformers' inkling2_text conversion renames `sconv.weight_proj` to
    `sconv.weight_proj.weight`, and peft's load renames adapter keys the same way. The
    recipe leaves that Linear out, names it with why, and its adapter loads back whole;
    a LoRA on it would not (the fact the override rests on)."""
    from moetune.model.saved_names import AdapterNamesError, checkpoint_named, loaded

    spec = _spec(model_type)
    config = build_peft_config(spec, LORA)
    recipe = make_recipe(spec, LORA)
    why = recipe.coverage.to_json()["not_targeted"]
    left_out = ["self_attn.k_proj.sconv.weight_proj", "self_attn.v_proj.sconv.weight_proj"]
    assert sorted(why) == left_out and all("renames" in w for w in why.values())
    assert recipe.coverage.coverage == 1.0 and "self_attn.k_proj.linear" in config.target_modules
    assert not any(t.endswith("weight_proj") for t in config.target_modules)
    base, tensors = _lora_tensors(spec, config)
    named = checkpoint_named(base, config, tensors)  # the names the adapter is written in
    assert loaded(base, config, named).keys() == tensors.keys()  # peft loads every tensor
    with_it = copy.deepcopy(config)
    with_it.target_modules = {*config.target_modules, "sconv.weight_proj"}
    base, tensors = _lora_tensors(spec, with_it)
    assert any("sconv.weight_proj.lora_A" in k for k in tensors)
    with pytest.raises(AdapterNamesError, match="weight_proj"):
        checkpoint_named(base, with_it, tensors)
