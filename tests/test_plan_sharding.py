"""The per-device planner: sharded terms scale 1/N, FSDP2 on one GPU is the single-device
plan plus its stated transient, the fewest GPUs are minimal, bad input is one line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import RunConfig, parse_config
from moetune.errors import ConfigError, UnknownCardError
from moetune.model import load_spec
from moetune.model.spec import ModelSpec
from moetune.plan.devices.sharding import (
    SHARDED,
    STRATEGIES,
    fewest_gpus,
    per_rank_bytes,
    plan_devices,
    run_sizes,
)
from moetune.plan.fit import analytic

GiB = 1024**3
LORA = {"lora": {"rank": 16, "targets": ["attention", "experts"]}, "train": {"seq_len": 2048}}
FULL = {"train": {"tuning": "full", "seq_len": 2048}}


@pytest.fixture(scope="module")
def qwen30b() -> ModelSpec:
    return load_spec("Qwen/Qwen3-30B-A3B")


@pytest.fixture(scope="module")
def qwen235b() -> ModelSpec:
    return load_spec("Qwen/Qwen3-235B-A22B")


@pytest.fixture(scope="module")
def lora() -> RunConfig:
    return parse_config(json.loads(json.dumps(LORA)))


def test_qwen3_235b_total_is_the_published_235b(qwen235b: ModelSpec) -> None:
    assert abs(qwen235b.total_params - 235e9) / 235e9 < 0.01


def test_fsdp_on_one_gpu_is_the_single_device_plan_plus_its_transient(
    qwen30b: ModelSpec, lora: RunConfig
) -> None:
    single = analytic(qwen30b, lora)
    sizes = run_sizes(qwen30b, lora)
    plan = plan_devices(qwen30b, lora, "H200", 1, "fsdp")
    transient = sizes.root + 2 * sizes.largest_layer  # root unit + running and prefetched layer
    comm = 2 * sizes.largest_layer_grads  # full-size layer gradient + its 1/1 shard
    assert plan.components["gathered_transient"] == transient
    assert plan.components["communication_buffers"] == comm
    assert plan.peak_bytes == single.peak_bytes + transient + comm
    for name, value in single.components.items():
        assert plan.components[name] == value


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
@pytest.mark.parametrize("gpus", [2, 3, 8])
def test_sharded_terms_scale_one_over_n(
    qwen30b: ModelSpec, lora: RunConfig, strategy: str, gpus: int
) -> None:
    single = analytic(qwen30b, lora).components
    per_rank = per_rank_bytes(qwen30b, lora, gpus, strategy)
    for name, value in single.items():
        expected = -(-value // gpus) if name in SHARDED else value  # ceil: a rank's shard
        assert per_rank[name] == expected, name
    assert per_rank["frozen_weights"] * gpus - single["frozen_weights"] < gpus


def test_ddp_replicates_everything_and_adds_the_gradient_buckets(
    qwen30b: ModelSpec, lora: RunConfig
) -> None:
    single = analytic(qwen30b, lora)
    per_rank = per_rank_bytes(qwen30b, lora, 8, "ddp")
    assert {k: per_rank[k] for k in single.components} == single.components
    assert per_rank["communication_buffers"] == single.trainable_params * 4  # fp32 LoRA grads


def test_full_finetune_layer_and_root_bytes_by_hand(qwen235b: ModelSpec) -> None:
    cfg = parse_config(json.loads(json.dumps(FULL)))
    sizes = run_sizes(qwen235b, cfg)
    h, heads, kv, d, experts, inter, vocab = 4096, 64, 4, 128, 128, 1536, 151_936
    attention = h * heads * d + 2 * h * kv * d + heads * d * h + 2 * d  # q k v o, q/k norm
    layer = attention + 2 * h + experts * 3 * h * inter + experts * h  # + 2 norms, router
    assert sizes.largest_layer == layer * 2  # bf16
    assert sizes.largest_layer_grads == layer * 2  # bf16 gradients of a full fine-tune
    assert sizes.root == (2 * vocab * h + h) * 2  # embeddings, LM head, final norm
    assert sizes.largest_module == experts * 3 * h * inter  # one layer's expert stacks


def _assert_fewest_minimal(spec: ModelSpec, cfg: RunConfig, strategy: str) -> dict[str, int]:
    found = {}
    for card in ("H100-80GB", "H200"):
        n = fewest_gpus(spec, cfg, card, strategy)
        assert n is not None and n > 1  # a 235B model fits no single card
        assert plan_devices(spec, cfg, card, n, strategy).fits
        assert not plan_devices(spec, cfg, card, n - 1, strategy).fits
        found[card] = n
    assert found["H200"] <= found["H100-80GB"]
    return found


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_fewest_gpus_is_minimal_full_finetune(qwen235b: ModelSpec, strategy: str) -> None:
    cfg = parse_config(json.loads(json.dumps(FULL)))
    found = _assert_fewest_minimal(qwen235b, cfg, strategy)
    # bf16 weights + bf16 grads + two bf16 Adam moments: 8 B per parameter, 1.75 TiB in all
    assert found["H200"] >= 8 * qwen235b.total_params // (140 * GiB)
    assert fewest_gpus(qwen235b, cfg, "H200", "ddp") is None  # replicas never shrink


@pytest.mark.slow  # peft's meta build of 94 layers for the LoRA layout: ~30 s cold
def test_fewest_gpus_is_minimal_lora_235b(qwen235b: ModelSpec, lora: RunConfig) -> None:
    found = _assert_fewest_minimal(qwen235b, lora, "fsdp")
    assert found["H200"] < found["H100-80GB"] <= 8  # the README example


def test_per_device_peak_falls_with_more_gpus(qwen30b: ModelSpec, lora: RunConfig) -> None:
    for strategy in ("fsdp", "zero3", "ep"):  # ep: the routed experts 1/N
        peaks = [sum(per_rank_bytes(qwen30b, lora, n, strategy).values()) for n in (1, 2, 4, 8)]
        assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]


def test_bad_strategy_gpus_and_card_are_user_errors(qwen30b: ModelSpec, lora: RunConfig) -> None:
    with pytest.raises(ConfigError, match="unknown strategy"):
        plan_devices(qwen30b, lora, "H200", 2, "zero2")
    with pytest.raises(ConfigError, match="--gpus"):
        plan_devices(qwen30b, lora, "H200", 0, "fsdp")
    with pytest.raises(UnknownCardError):
        fewest_gpus(qwen30b, lora, "H900", "fsdp")
    assert set(STRATEGIES) == {"ddp", "fsdp", "zero3", "ep"}


def test_cli_plan_gpus_json_and_errors() -> None:
    runner = CliRunner()
    args = ["plan", "Qwen/Qwen3-30B-A3B", "--card", "RTX-4090", "--card", "H200", "--seq", "2048"]
    result = runner.invoke(app, [*args, "--gpus", "2", "--strategy", "fsdp", "--json"])
    assert result.exit_code == 0, result.stderr
    devices = json.loads(result.stdout)["devices"]
    assert devices["gpus"] == 2 and devices["strategy"] == "fsdp"
    assert devices["peak_bytes"] == sum(devices["components"].values())
    four = devices["cards"]["RTX-4090"]["fewest_gpus"]
    assert four is not None and four > 2 and not devices["cards"]["RTX-4090"]["fits"]
    assert devices["cards"]["H200"]["fits"]
    bad = runner.invoke(app, [*args, "--gpus", "2", "--strategy", "tp"])
    assert (
        bad.exit_code == 2
        and "--strategy tp: train.strategy must be one of ddp | fsdp | zero3" in bad.stderr
    )
    assert len(bad.stderr.strip().splitlines()) == 1
    assert "Traceback" not in bad.stderr


def test_device_report_says_what_the_analytic_leaves_out(monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.model import spec_from_config
    from moetune.model.tiny import tiny_config
    from moetune.plan.devices.sharding import device_report
    from moetune.plan.profiles.registry import PROFILES, ActivationProfile

    # jamba as it planned before its Mamba1 term: a real family whose kind has no term
    monkeypatch.setitem(PROFILES, "jamba", ActivationProfile(mixers={"mamba": None}))
    spec = spec_from_config(tiny_config("jamba"), "tiny-jamba")
    report = device_report(spec, parse_config({"lora": {"rank": 4}}), ["H200"], 2, "fsdp")
    assert report.fewest["H200"] == 1 and report.plans["H200"].fits
    assert any("mamba" in n and "left out" in n for n in report.notes)
    assert report.to_json()["notes"] == list(report.notes)


def test_sharded_plans_name_the_host_ram_a_node_needs_at_load(
    qwen235b: ModelSpec, lora: RunConfig
) -> None:
    """fsdp loads the base once per node (rank 0 reads it, the others get their shards),
    bf16, int8 and NF4 experts alike; zero3 too with bf16 experts (built under zero.Init),
    and whole on every rank with int8 / NF4 stacks (moetune's own loader)."""
    from moetune.plan.devices.host_ram import RUNTIME_HOST_BYTES
    from moetune.plan.devices.sharding import device_report, run_sizes
    from moetune.units import human_bytes

    sizes = run_sizes(qwen235b, lora)
    whole = sizes.single["frozen_weights"] + sizes.single["trainable_weights"]
    assert whole > 400 * 2**30  # the 235B base in bf16
    fsdp = device_report(qwen235b, lora, ["H200"], 8, "fsdp")
    host = fsdp.to_json()["host_ram"]
    flight = sizes.largest_module * sizes.weight_bytes  # a layer's expert stacks, in flight
    assert host["main_rank_bytes"] == RUNTIME_HOST_BYTES + whole + flight
    assert host["other_rank_bytes"] == RUNTIME_HOST_BYTES + -(-whole // 8) + flight
    assert whole < host["per_node_bytes"] < 1.25 * whole  # ≈ one base, not 8
    (load,) = [n for n in fsdp.notes if "host RAM" in n]
    assert human_bytes(host["per_node_bytes"]) in load and "not 8" in load
    zero3 = device_report(qwen235b, lora, ["H200"], 8, "zero3")
    each = RUNTIME_HOST_BYTES + -(-whole // 8) + flight  # its partition + a module scattered
    got = zero3.to_json()["host_ram"]
    assert got["main_rank_bytes"] == got["other_rank_bytes"] == each
    assert got["per_node_bytes"] == 8 * each and whole < 8 * each < 1.25 * whole
    (load,) = [n for n in zero3.notes if "host RAM" in n]
    assert "zero.Init" in load and f"each rank peaks at {human_bytes(each)}" in load
    assert f"about {human_bytes(8 * each)} (≈ one base, not 8" in load
    for experts_dtype in ("int8", "nf4"):  # once per node too, at the quantised bytes
        model = lora.model.model_copy(update={"experts_dtype": experts_dtype})
        quant = lora.model_copy(update={"model": model})
        held = run_sizes(qwen235b, quant).single
        base = held["frozen_weights"] + held["trainable_weights"]
        assert base < whole * (0.55 if experts_dtype == "int8" else 0.35)  # attention: bf16
        got = device_report(qwen235b, quant, ["H200"], 8, "fsdp").to_json()["host_ram"]
        assert got["main_rank_bytes"] == RUNTIME_HOST_BYTES + base + flight  # a float stack
        assert got["other_rank_bytes"] == RUNTIME_HOST_BYTES + -(-base // 8) + flight
        assert got["per_node_bytes"] == 8 * (RUNTIME_HOST_BYTES + flight) + base
        whole_each = device_report(qwen235b, quant, ["H200"], 8, "zero3").host
        assert whole_each is not None  # moetune streams the stacks: whole on every rank
        assert whole_each.per_node_bytes == 8 * (RUNTIME_HOST_BYTES + base)
    ddp = device_report(qwen235b, lora, ["H200"], 8, "ddp")
    assert not any("host RAM" in n for n in ddp.notes) and ddp.host is None
    ep = device_report(qwen235b, lora, ["H200"], 8, "ep").to_json()["host_ram"]
    rest = whole - sizes.expert_weights  # read whole on every rank; the experts 1/8 each
    each = RUNTIME_HOST_BYTES + rest + -(-sizes.expert_weights // 8)
    assert ep["main_rank_bytes"] == ep["other_rank_bytes"] == each
    assert ep["per_node_bytes"] == 8 * each < 1.5 * whole  # the experts once, the rest 8×
    assert not ep["once_per_node"] and "reads its E/N routed experts' bytes" in ep["how"]


def test_several_nodes_plan_each_rank_of_all_and_host_ram_per_node(
    qwen235b: ModelSpec, lora: RunConfig
) -> None:
    """2 nodes × 8 GPUs: each rank holds 1/16 (the plan of 16 ranks); host RAM is per node,
    for its own 8 ranks – the same as one node of 8, whatever the node count."""
    from moetune.plan.devices.sharding import device_report, node_host_ram, run_sizes
    from moetune.units import human_bytes

    two = device_report(qwen235b, lora, ["H200"], 8, "fsdp", nodes=2)
    sixteen = device_report(qwen235b, lora, ["H200"], 16, "fsdp")
    assert two.gpus == 16 and two.components == sixteen.components
    assert two.placement == "2 nodes × 8 GPU(s)" and sixteen.placement == "16 GPU(s)"
    ram = node_host_ram(run_sizes(qwen235b, lora), 8, two.host)  # the sharded load, per node
    (node,) = [n for n in two.notes if n.startswith("2 nodes × 8 GPU(s) = 16 ranks")]
    assert f"per node: 8 GPU(s) and about {human_bytes(ram)} of host RAM" in node
    four = device_report(qwen235b, lora, ["H200"], 8, "fsdp", nodes=4)
    assert human_bytes(ram) in next(n for n in four.notes if "per node" in n)
    assert two.to_json()["nodes"] == 2 and two.to_json()["gpus_per_node"] == 8
    with pytest.raises(ConfigError, match="--nodes"):
        device_report(qwen235b, lora, ["H200"], 8, "fsdp", nodes=0)


def test_cli_plan_nodes_defaults_to_the_configs(tmp_path) -> None:
    runner = CliRunner()
    args = ["plan", "Qwen/Qwen3-30B-A3B", "--card", "H200", "--json"]
    got = runner.invoke(app, [*args, "--nodes", "2", "--gpus", "4"])
    assert got.exit_code == 0, got.stderr
    devices = json.loads(got.stdout)["devices"]
    assert (devices["nodes"], devices["gpus_per_node"], devices["gpus"]) == (2, 4, 8)
    from_config = runner.invoke(app, [*args, "--gpus", "4", "--set", "train.nnodes=3"])
    assert json.loads(from_config.stdout)["devices"]["gpus"] == 12
    text = runner.invoke(app, [*args[:-1], "--nodes", "2", "--gpus", "4"])
    assert "per-device peak on 2 nodes × 4 GPU(s)" in text.stdout
