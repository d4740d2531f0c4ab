"""The fake-tensor trace of a training step: byte-exact against a real step, counted once.

Tiny Qwen3-MoE configs run in bf16: transformers' default `grouped_mm` experts path only
accepts bf16 (its meta kernel rejects fp32), and bf16 runs on CPU for real.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from peft import LoraConfig
from transformers import Qwen3MoeConfig

from moetune.errors import ConfigError
from moetune.plan.trace.bytes import CATEGORIES, ByteTracker
from moetune.plan.trace.fake_step import TraceResult, trace_step

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
AUTO_MAPPED = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


def tiny_config(**overrides: Any) -> Qwen3MoeConfig:
    fields: dict[str, Any] = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": 100,
        "max_position_embeddings": 256,
    }
    return Qwen3MoeConfig(**{**fields, **overrides})


def lora(**overrides: Any) -> LoraConfig:
    fields: dict[str, Any] = {
        "r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.0,
        "target_modules": ATTENTION,
        "target_parameters": EXPERTS,
    }
    return LoraConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def config() -> Qwen3MoeConfig:
    return tiny_config()


def trace(config: Qwen3MoeConfig, peft: LoraConfig | None, **kwargs: Any) -> TraceResult:
    """Full-logits loss unless asked: TRL's fused head allocates a fixed 4096×32768 tile
    that would dominate every tiny step (the fused head has tests of its own below)."""
    return trace_step(config, peft, **{"seq_len": 16, "loss": "full", **kwargs})


def same_step(fake: TraceResult, real: TraceResult) -> None:
    assert fake.peak_bytes == real.peak_bytes
    assert fake.at_peak == real.at_peak
    assert (fake.peak_op, fake.peak_phase, fake.peak_step) == (
        real.peak_op,
        real.peak_phase,
        real.peak_step,
    )
    assert (fake.trainable_params, fake.total_params) == (real.trainable_params, real.total_params)


# --- byte-exact: fake == real ------------------------------------------------------------


@pytest.mark.parametrize("gc", [True, False], ids=["gc-on", "gc-off"])
@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_fake_trace_matches_real_step_byte_for_byte(config: Qwen3MoeConfig, gc: bool, adapter: str):
    peft = lora() if adapter == "lora" else None
    fake = trace(config, peft, gradient_checkpointing=gc)
    real = trace(config, peft, gradient_checkpointing=gc, fake=False)
    same_step(fake, real)


@pytest.mark.parametrize(("optimizer", "steps"), [("foreach", 2), ("for-loop", 1)])
def test_byte_exact_for_other_optimizers_batches_and_steady_state(
    config: Qwen3MoeConfig, optimizer: str, steps: int
):
    # peft auto-maps gate/up/down onto the fused experts (gate_up at rank 2r)
    peft = lora(target_modules=AUTO_MAPPED, target_parameters=None)
    kwargs = {
        "optimizer": optimizer,
        "steps": steps,
        "batch_size": 2,
        "gradient_checkpointing": False,
    }
    same_step(trace(config, peft, **kwargs), trace(config, peft, fake=False, **kwargs))


@pytest.mark.parametrize("gc", [True, False], ids=["gc-on", "gc-off"])
def test_fused_lm_head_step_is_byte_exact(config: Qwen3MoeConfig, gc: bool):
    kwargs = {"gradient_checkpointing": gc, "loss": "fused", "seq_len": 64}
    same_step(trace(config, lora(), **kwargs), trace(config, lora(), fake=False, **kwargs))


def test_fused_lm_head_never_holds_the_logits():
    # What moetune's trainer runs (TRL SFTTrainer's fused LM head): the loss costs one
    # bf16 tile of 4096 tokens × 32768 vocab entries, not fp32 tokens × vocab logits.
    config = tiny_config(vocab_size=40_000)
    seq = 1024
    full = trace(config, lora(), seq_len=seq)
    fused = trace(config, lora(), seq_len=seq, loss="fused")
    assert full.peak_bytes - fused.peak_bytes > 4 * seq * config.vocab_size  # fp32 logits at least
    tile = seq * 32_768 * 2
    assert tile <= fused.at_peak["activations"] < tile + 2 * seq * config.vocab_size // 4


def test_unknown_loss_is_a_config_error(config: Qwen3MoeConfig):
    with pytest.raises(ConfigError, match="unknown loss"):
        trace(config, None, loss="chunked")


# --- counting once and categories --------------------------------------------------------


def frozen_bytes(config: Qwen3MoeConfig) -> int:
    """Base parameters in bf16 plus the rotary buffers (inv_freq and its original, fp32)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    head_dim = config.head_dim
    return 2 * sum(p.numel() for p in model.parameters()) + 2 * 4 * (head_dim // 2)


def test_parametrized_expert_stacks_are_counted_once(config: Qwen3MoeConfig):
    # peft re-wraps the expert stacks on every forward; pre-registered, they stay one copy.
    result = trace(config, lora(), gradient_checkpointing=False)
    assert result.at_peak["frozen_weights"] == frozen_bytes(config)


def test_tracker_counts_views_once_and_frees_dead_storage():
    weight = torch.zeros(64, dtype=torch.bfloat16)
    tracker = ByteTracker()
    tracker.register([weight], "frozen_weights")
    with tracker:
        alias = weight.view(8, 8).t()  # views share the registered storage: no new bytes
        assert tracker.live_bytes == 128
        temp = weight.float()  # a new storage: 256 bytes
        assert tracker.live_bytes == 128 + 256
        del temp
    assert tracker.live_bytes == 128
    assert tracker.peak.bytes == 384 and tracker.peak.op == "aten._to_copy.default"
    assert tracker.at_peak() == {
        **dict.fromkeys(CATEGORIES, 0),
        "frozen_weights": 128,
        "activations": 256,
    }
    del alias


def test_unregistered_weights_count_again_when_rewrapped():
    # Why pre-registration matters: a storage first seen as an op's output looks freshly allocated.
    weight = torch.zeros(64, dtype=torch.bfloat16)
    tracker = ByteTracker()
    with tracker:
        rewrapped = torch.ops.aten.alias.default(weight)
    assert tracker.live_bytes == 128
    del rewrapped


def test_categories_sum_to_peak_with_exact_adam_state(config: Qwen3MoeConfig):
    result = trace(config, lora(r=8))  # adapter state outweighs the checkpointed activations
    trainable_tensors = 2 * (len(ATTENTION) + len(EXPERTS)) * config.num_hidden_layers
    fp32 = 4 * result.trainable_params  # peft keeps adapter weights in fp32
    assert result.peak_phase == "optimizer"
    assert sum(result.at_peak.values()) == result.peak_bytes
    assert result.at_peak["trainable_weights"] == fp32
    assert result.at_peak["gradients"] == fp32
    # exp_avg + exp_avg_sq, plus one fp32 `step` scalar per tensor (fused keeps it on device)
    assert result.at_peak["optimizer_state"] == 2 * fp32 + 4 * trainable_tensors
    assert result.at_peak["frozen_weights"] == frozen_bytes(config)


def test_full_fine_tune_trains_every_parameter_in_model_dtype(config: Qwen3MoeConfig):
    result = trace(config, None)
    assert result.trainable_params == result.total_params
    assert result.at_peak["trainable_weights"] == 2 * result.total_params  # bf16
    assert result.at_peak["gradients"] == 2 * result.total_params


# --- behaviour -----------------------------------------------------------------------------


def test_checkpointing_lowers_the_peak_when_activations_dominate():
    config = tiny_config(hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    on = trace(config, lora(), seq_len=128, gradient_checkpointing=True)
    off = trace(config, lora(), seq_len=128, gradient_checkpointing=False)
    assert off.at_peak["activations"] > off.peak_bytes / 2
    assert on.peak_bytes < off.peak_bytes


def test_longer_sequences_need_more_bytes(config: Qwen3MoeConfig):
    peaks = [
        trace(config, lora(), seq_len=n, gradient_checkpointing=False).peak_bytes
        for n in (16, 32, 64)
    ]
    assert peaks[0] < peaks[1] < peaks[2]


def test_peak_names_the_op_and_phase(config: Qwen3MoeConfig):
    # Without checkpointing the fp32 log-softmax of the loss peaks on the way back.
    result = trace(config, lora(), gradient_checkpointing=False)
    assert result.peak_op == "aten._log_softmax_backward_data.default"
    assert result.peak_phase == "backward"
    assert result.seconds > 0


def test_optimizer_choice_changes_only_the_optimizer_transients(config: Qwen3MoeConfig):
    fused = trace(config, lora(r=8), optimizer="fused")
    foreach = trace(config, lora(r=8), optimizer="foreach")
    assert foreach.peak_op == "aten._foreach_sqrt.default"
    # foreach holds a full-size fp32 sqrt(exp_avg_sq) temporary; fused holds none.
    assert foreach.peak_bytes - fused.peak_bytes == 4 * fused.trainable_params


def test_steady_state_keeps_adam_moments_through_backward(config: Qwen3MoeConfig):
    one = trace(config, lora(), gradient_checkpointing=False)
    two = trace(config, lora(), gradient_checkpointing=False, steps=2)
    assert (two.peak_step, two.peak_phase) == (2, "backward")
    assert two.peak_bytes - one.peak_bytes == two.at_peak["optimizer_state"]


def test_inputs_are_not_modified(config: Qwen3MoeConfig):
    peft = lora(target_modules=AUTO_MAPPED, target_parameters=None)  # peft rewrites these
    before_modules, before_dtype = set(AUTO_MAPPED), config.dtype
    trace(config, peft)
    assert peft.target_modules == before_modules
    assert config.dtype == before_dtype


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"seq_len": 0},
        {"batch_size": -1},
        {"steps": 0},
        {"optimizer": "sgd"},
        {"device": "cuda"},  # fake traces run on cpu
        {"device": "gpu0"},
    ],
)
def test_bad_input_is_a_config_error_with_a_fix(config: Qwen3MoeConfig, kwargs: dict[str, Any]):
    with pytest.raises(ConfigError) as info:
        trace(config, None, **kwargs)
    assert info.value.cause and info.value.fix


def test_a_data_dependent_experts_loop_traces_balanced_byte_for_byte():
    """The eager loop reads its routing (nonzero, .item()); both steps route balanced
    (plan.balanced), so the fake one allocates exactly what the real one does."""
    config = tiny_config(experts_implementation="eager")  # loops over the experts that got tokens
    fake, real = trace(config, lora()), trace(config, lora(), fake=False)
    same_step(fake, real)
    assert fake.peak_bytes > 0 and fake.ops > 0


# --- the published figures (slow) ------------------------------------------------------------


def qwen3_30b() -> Any:
    from moetune.model import load_spec, to_hf_config

    return to_hf_config(load_spec("Qwen/Qwen3-30B-A3B"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("seq_len", "gc", "gib", "phase"),
    [
        (1024, True, 72.1, "optimizer"),
        (1024, False, 128.1, "backward"),
        (2048, True, 71.8, "optimizer"),
        (8192, True, 76.1, "backward"),
        (2048, False, 139.1, "backward"),
    ],
)
def test_qwen3_30b_a3b_figures(seq_len: int, gc: bool, gib: float, phase: str):
    peft = lora(r=16, lora_alpha=32, target_modules=AUTO_MAPPED, target_parameters=None)
    result = trace_step(
        qwen3_30b(), peft, seq_len=seq_len, gradient_checkpointing=gc, loss="full"
    )  # the [1/5] reference figures: full logits
    assert result.trainable_params == 994_836_480
    assert result.total_params == 30_532_122_624 + 994_836_480
    assert result.peak_bytes / 2**30 == pytest.approx(gib, rel=0.03)
    assert result.peak_phase == phase


@pytest.mark.slow
def test_qwen3_30b_a3b_explicit_expert_targets_do_not_double_the_rank():
    peft = lora(r=16, lora_alpha=32)
    result = trace_step(qwen3_30b(), peft, seq_len=128)
    assert result.trainable_params == 642_514_944
