"""Expert parallelism, planned as moetune trains it (`train.strategy ep`): each device holds
1/EP of the routed experts and of their LoRA state, the rest replicated (DDP's buckets), plus
one layer's all-to-all buffers at balanced routing (the skew stated); `plan --gpus N` states
it, and names other engines only for full fine-tuning, which moetune's ep does not train."""

from __future__ import annotations

from typing import Any

import pytest

from moetune.config import RunConfig, parse_config
from moetune.model import spec_from_config
from moetune.model.census import shrunk_config
from moetune.model.spec import ModelSpec
from moetune.plan.devices.sharding import device_report, plan_expert_parallel
from moetune.plan.fit import analytic
from moetune.plan.layout import adapter_layout
from moetune.units import human_bytes


@pytest.fixture(scope="module")
def tiny() -> ModelSpec:
    return spec_from_config(shrunk_config("qwen3_moe"), "qwen3_moe")  # 4 layers, 4 experts


def cfg(**train: Any) -> RunConfig:
    lora = {"rank": 4, "targets": ["attention", "experts"]}
    return parse_config({"lora": lora, "train": {"seq_len": 64, **train}})


def test_experts_split_across_devices_the_rest_replicated(tiny: ModelSpec) -> None:
    run = cfg()
    single = analytic(tiny, run).components
    ep = plan_expert_parallel(tiny, run, 2)
    assert ep is not None and ep.ep == 2 and ep.experts_per_device == 2
    experts = 4 * (4 * 3 * 32 * 64) * 2  # layers × experts × 3·I·H × bf16
    assert ep.components["expert_weights"] == experts // 2
    assert ep.components["frozen_weights"] == single["frozen_weights"] - experts
    layout = adapter_layout(tiny, run.lora)
    expert_lora = sum(a.lora_numel for layer in layout.layers for a in layer if a.kind == "experts")
    other_lora = layout.trainable_params - expert_lora
    # each device holds its own experts' LoRA only: weights (fp32), grads and Adam state of
    # the experts' LoRA halved, the rest whole; DDP's buckets hold the replicated LoRA only
    assert ep.components["trainable_weights"] == 4 * (other_lora + expert_lora // 2)
    assert ep.components["communication_buffers"] == 4 * other_lora
    for name in ("trainable_weights", "gradients", "optimizer_state", "optimizer_transients"):
        halved = single[name] * expert_lora / layout.trainable_params / 2
        assert abs(single[name] - ep.components[name] - halved) <= 1  # rounding only
    assert ep.components["activations"] == single["activations"]  # own micro-batch
    assert ep.components["all_to_all_buffers"] == 2 * 64 * 2 * 64 * 2  # in+out, T, k, H, bf16
    assert ep.peak_bytes == sum(ep.components.values())


def test_ep_is_at_most_the_number_of_experts_and_needs_two_devices(tiny: ModelSpec) -> None:
    wide = plan_expert_parallel(tiny, cfg(), 8)
    assert wide is not None and wide.ep == 4 and wide.experts_per_device == 1
    assert plan_expert_parallel(tiny, cfg(), 1) is None
    dense = spec_from_config(shrunk_config("llama"), "llama")
    assert plan_expert_parallel(dense, cfg(), 4) is None


def test_the_device_report_states_it_as_trained_by_moetune(tiny: ModelSpec) -> None:
    report = device_report(tiny, cfg(), ["H100-80GB"], 2, "fsdp")
    assert report.expert_parallel is not None
    doc = report.to_json()["expert_parallel"]
    assert doc["ep"] == 2 and doc["fits"] == {"H100-80GB": True}
    assert doc["trained_by_moetune"] and doc["engines"] == []
    assert doc["skew_assumed"] == "balanced"
    assert doc["worst_skew_all_to_all_bytes"] == 2 * doc["components"]["all_to_all_buffers"]
    note = next(n for n in report.notes if n.startswith("expert parallelism (EP = 2"))
    assert "moetune trains it: train.strategy ep" in note and "does not" not in note


def test_plan_strategy_ep_gives_the_same_per_device_peak(tiny: ModelSpec) -> None:
    """`--strategy ep`'s per-rank plan (what the run's preflight plans) and the EP figure
    beside any strategy agree, byte for byte, and state the skew assumed."""
    report = device_report(tiny, cfg(), ["H100-80GB"], 2, "ep")
    ep = report.expert_parallel
    assert ep is not None and sum(report.components.values()) == ep.peak_bytes
    assert report.components["all_to_all_buffers"] == ep.components["all_to_all_buffers"]
    assert any("balanced routing" in n for n in report.plans["H100-80GB"].notes)


def test_full_fine_tuning_names_the_engines_that_train_it(tiny: ModelSpec) -> None:
    ep = plan_expert_parallel(tiny, cfg(tuning="full"), 2)
    assert ep is not None and not ep.to_json()["trained_by_moetune"]
    assert any("Megatron-Core" in e for e in ep.engines)
    assert any("torchtitan" in e for e in ep.engines)


def test_fewest_gpus_for_ep_divide_the_experts() -> None:
    """ep places E/N experts a rank: the fewest GPUs it offers divide E (the launcher
    refuses any other count)."""
    from moetune.model import load_spec
    from moetune.plan.devices.sharding import fewest_gpus

    spec = load_spec("Qwen/Qwen3-30B-A3B")  # 128 experts
    n = fewest_gpus(spec, cfg(), "RTX-4090", "ep")
    assert n is not None and spec.num_experts % n == 0 and n > 1


@pytest.mark.parametrize(("seq", "fsdp_less"), [(2048, True), (64, False)])
def test_the_plan_says_where_fsdp2_holds_less_per_device(tiny: ModelSpec, seq, fsdp_less) -> None:
    """`plan --gpus N --strategy ep` names FSDP2 where it holds less per device than ep
    (the tiny model at seq 2048, as Qwen3-235B on 8 GPUs), with both figures, and says
    nothing where ep holds less (seq 64)."""
    from moetune.plan.devices.sharding import get_strategy, run_sizes

    run = cfg(seq_len=seq)
    report = device_report(tiny, run, ["H100-80GB"], 2, "ep")
    fsdp = sum(get_strategy("fsdp").components(run_sizes(tiny, run), 2).values())
    assert report.expert_parallel is not None
    assert (fsdp < report.expert_parallel.peak_bytes) is fsdp_less
    said = [n for n in report.notes if n.startswith("FSDP2 holds less per device")]
    assert len(said) == int(fsdp_less)
    if fsdp_less:
        assert human_bytes(fsdp) in said[0] and "--strategy fsdp" in said[0]


@pytest.mark.parametrize(("gpus", "degree"), [(2, 2), (4, 2), (4, 4), (8, 2), (8, 4)])
def test_the_ep_figure_reads_ep_degree_as_the_per_rank_plan(tiny: ModelSpec, gpus, degree) -> None:
    """train.ep_degree: the ep figure beside any strategy holds E/ep_degree experts a rank and
    1/N of the rest (FSDP2 over every rank) – byte for byte `--strategy ep`'s per-rank plan."""
    from moetune.plan.devices.sharding import per_rank_bytes, run_sizes

    run = cfg(ep_degree=degree)
    sizes = run_sizes(tiny, run)
    ep = plan_expert_parallel(tiny, run, gpus, sizes)
    assert ep is not None and (ep.ep, ep.experts_per_device) == (degree, 4 // degree)
    assert ep.peak_bytes == sum(per_rank_bytes(tiny, run, gpus, "ep").values())
    assert ep.components["expert_weights"] == sizes.expert_weights // degree
    rest = sizes.single["frozen_weights"] - sizes.expert_weights
    assert ep.components["frozen_weights"] == -(-rest // gpus)
    assert ep.to_json()["rest_sharded_over"] == gpus
    said = ep.describe()
    assert f"in groups of {degree} ranks, the rest FSDP2-sharded over {gpus}" in said
    assert f"all the LoRA state 1/{gpus} (FSDP2)" in said and "own device only" not in said


@pytest.mark.parametrize(("degree", "fewest"), [(None, 4), (8, 8), (16, 16)])
def test_fewest_gpus_keep_to_whole_expert_groups(degree, fewest) -> None:
    """The fewest GPUs ep offers are counts it runs on: a multiple of train.ep_degree (whole
    groups), each group dividing the 128 experts – and each fits while fewer do not."""
    from moetune.model import load_spec
    from moetune.plan.devices.sharding import fewest_gpus, plan_devices

    spec = load_spec("Qwen/Qwen3-30B-A3B")
    run = cfg(ep_degree=degree, seq_len=2048)
    n = fewest_gpus(spec, run, "RTX-4090", "ep")
    assert n == fewest and n % (degree or 1) == 0 and spec.num_experts % (degree or n) == 0
    assert plan_devices(spec, run, "RTX-4090", n, "ep").fits
    if degree is None:  # 2 GPUs (the divisor below) do not fit
        assert not plan_devices(spec, run, "RTX-4090", 2, "ep").fits


@pytest.mark.parametrize(
    ("model", "extra", "says"),
    [("Qwen/Qwen3-30B-A3B", ["--gpus", "3"], "128 routed experts do not split evenly over 3"),
     ("Qwen/Qwen3-30B-A3B", ["--gpus", "256"], "256 expert-parallel ranks for 128 routed experts"),
     ("Qwen/Qwen3-30B-A3B", ["--gpus", "4", "--set", "train.ep_degree=3"],
      "train.ep_degree 3 does not divide the 4 ranks"),
     ("Qwen/Qwen3-30B-A3B", ["--gpus", "6", "--set", "train.ep_degree=3"],
      "128 routed experts do not split evenly over 3 ranks (train.ep_degree"),
     ("meta-llama/Llama-3.1-8B", ["--gpus", "2", "--targets", "attention"],
      "strategy ep places routed experts, and meta-llama/Llama-3.1-8B has none")],
)  # fmt: skip
def test_plan_refuses_an_ep_split_that_cannot_run(model, extra, says) -> None:
    """What the launcher refuses, `plan --strategy ep` refuses too: one line and exit 2 (and
    one JSON object with --json), never a per-rank figure of a run that cannot start."""
    import json

    from typer.testing import CliRunner

    from moetune.cli import app

    args = ["plan", model, "--strategy", "ep", "--card", "H100-80GB", *extra]
    got = CliRunner().invoke(app, args)
    assert got.exit_code == 2 and says in got.stderr and "fix:" in got.stderr, got.output
    assert len(got.stderr.strip().splitlines()) == 1 and "Traceback" not in got.output
    doc = CliRunner().invoke(app, [*args, "--json"])
    assert doc.exit_code == 2 and says in json.loads(doc.stdout)["error"]["cause"]


def test_fsdp2_is_not_named_for_a_base_kept_as_stored() -> None:
    """Qwen3-235B-A22B-FP8 on 4 × H100-80GB: ep fits with the experts as stored, and though
    FSDP2's figure is no larger, the plan does not name it – on several processes FSDP2
    refuses a base kept as stored (train/stored.py). (A float base is told: above.)"""
    from moetune.model import load_spec
    from moetune.plan.devices.sharding import get_strategy, run_sizes

    spec = load_spec("Qwen/Qwen3-235B-A22B-FP8")
    run = parse_config({"model": {"id": spec.name}})
    report = device_report(spec, run, ["H100-80GB"], 4, "ep")
    fsdp = sum(get_strategy("fsdp").components(run_sizes(spec, run), 4).values())
    assert report.expert_parallel is not None and fsdp <= report.expert_parallel.peak_bytes
    assert report.plans["H100-80GB"].fits and report.fewest["H100-80GB"] == 4
    assert not any(n.startswith("FSDP2 holds less") for n in report.notes)


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_fewest_gpus_of_a_base_kept_as_stored_is_one_or_none_but_under_ep(strategy) -> None:
    """The launcher trains a base kept as stored on several processes under ep only
    (train/stored.py), so another strategy's fewest is 1 where it fits there, else none –
    never a count it refuses – and the plan says why, pointing at --strategy ep. Bundled
    configs: Qwen3-235B-A22B-FP8 (no one H100) and Qwen3-30B-A3B-FP8-dynamic (one H100)."""
    from moetune.model import load_spec
    from moetune.plan.devices.sharding import fewest_gpus

    big = load_spec("Qwen/Qwen3-235B-A22B-FP8")
    run = parse_config({"model": {"id": big.name}})
    inflated = parse_config({"model": {"id": big.name, "quantized_base": "dequantize"}})
    assert fewest_gpus(big, inflated, "H100-80GB", strategy) > 1  # a float base: several
    report = device_report(big, run, ["H100-80GB"], 4, strategy)
    assert report.fewest["H100-80GB"] is None and report.fewest_limit == 1
    assert report.to_json()["fewest_gpus_limit"] == 1 and not report.to_json()["launches"]
    note = next(n for n in report.notes if n.startswith("a base kept as stored"))
    assert "--strategy ep" in note and f"refuses {strategy}" in note
    ep = device_report(big, run, ["H100-80GB"], 4, "ep")
    assert ep.fewest["H100-80GB"] == 4 and ep.launches
    if strategy == "fsdp":  # the fit table says it in words
        from typer.testing import CliRunner

        from moetune.cli import app

        args = ["plan", big.name, "--strategy", strategy, "--gpus", "4", "--card", "H100-80GB"]
        got = CliRunner(env={"COLUMNS": "200"}).invoke(app, args)
        assert got.exit_code == 0 and "not on 1; several: ep only" in got.stdout, got.output
        assert "refused" in got.stdout  # the 4-GPU figure fits, and the launcher refuses it
    small = load_spec("RedHatAI/Qwen3-30B-A3B-FP8-dynamic")
    one = parse_config({"model": {"id": small.name}})
    assert fewest_gpus(small, one, "H100-80GB", strategy) == 1
