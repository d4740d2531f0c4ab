"""The offload plan: bytes by place and bytes moved by hand on a tiny spec, step time =
max(compute, transfer), the refusals, the recommendation that offers it where nothing else
fits, and the published example (Qwen3-235B-A22B on one H100-80GB / one GH200)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import RunConfig, parse_config
from moetune.errors import ConfigError
from moetune.model import load_spec, spec_from_config
from moetune.model.census import shrunk_config
from moetune.model.spec import ModelSpec
from moetune.plan import make_plan
from moetune.plan.fit import analytic
from moetune.plan.hardware import get_card
from moetune.plan.offload.memory import (
    CPU_PROCESS_BASELINE,
    CUDA_HOST_BASELINE,
    offload_plans,
    plan_offload,
)

GiB = 1024**3


def cfg(offload: str = "cpu", **train: Any) -> RunConfig:
    raw: dict[str, Any] = {
        "lora": {"rank": 4, "targets": ["attention", "experts"]},
        "train": {"seq_len": 64, "offload": offload, **train},
    }
    return parse_config(raw)


@pytest.fixture(scope="module")
def tiny() -> ModelSpec:
    return spec_from_config(shrunk_config("qwen3_moe"), "qwen3_moe")


@pytest.fixture(scope="module")
def qwen235b() -> ModelSpec:
    return load_spec("Qwen/Qwen3-235B-A22B")


def test_tiny_spec_is_the_shape_the_hand_figures_use(tiny: ModelSpec) -> None:
    assert (tiny.num_experts, tiny.hidden_size, tiny.expert_intermediate_size) == (4, 64, 32)
    assert len(tiny.moe_layers) == 4


def test_streamed_buffers_and_bytes_moved_by_hand(tiny: ModelSpec) -> None:
    layer = 4 * 3 * 32 * 64 * 2  # experts × (gate, up, down) × I × H × bf16 bytes = 49,152
    plan = plan_offload(tiny, cfg(), "H100-80GB")
    assert plan.layer_expert_bytes == layer
    assert plan.device_components["streamed_experts"] == 2 * layer  # running + prefetched
    assert plan.offloaded_bytes == 4 * layer
    # gradient checkpointing on: forward, the recompute and the backward each read every layer
    assert plan.bytes_moved_per_step == {"forward": 4 * layer, "recompute": 4 * layer,
                                         "backward": 4 * layer}  # fmt: skip
    off = plan_offload(tiny, cfg(gradient_checkpointing=False), "H100-80GB")
    assert off.bytes_moved_per_step == {"forward": 4 * layer, "recompute": 0, "backward": 4 * layer}
    accum = plan_offload(tiny, cfg(grad_accum=3), "H100-80GB")
    assert accum.bytes_moved_per_step["forward"] == 3 * 4 * layer  # per optimizer step


def test_step_time_is_the_larger_of_compute_and_transfer(tiny: ModelSpec) -> None:
    plan = plan_offload(tiny, cfg(), "H100-80GB")
    assert plan.transfer_s == pytest.approx(12 * plan.layer_expert_bytes / 50e9)  # PCIe 5 x16
    assert plan.step_time_s == max(plan.compute_s, plan.transfer_s)
    assert plan.tokens_per_s == pytest.approx(64 / plan.step_time_s)
    # at the balance point compute and transfer are equal
    at = plan_offload(tiny, cfg(seq_len=plan.balance_tokens), "H100-80GB")
    assert at.compute_s == pytest.approx(at.transfer_s, rel=0.01)
    assert at.transfer_s == pytest.approx(plan.transfer_s)


def test_device_holds_everything_but_the_offloaded_stacks(tiny: ModelSpec) -> None:
    run = cfg()
    est = analytic(tiny, run)
    plan = plan_offload(tiny, run, "H100-80GB")
    parts = plan.device_components
    assert parts["resident_weights"] == est.components["frozen_weights"] - plan.offloaded_bytes
    assert parts["lora"] == est.components["trainable_weights"]
    assert parts["optimizer_state"] == est.components["optimizer_state"]
    assert parts["overhead"] > 0 and plan.device_peak_bytes == sum(parts.values())
    assert plan.pinned_host_bytes == plan.offloaded_bytes  # cpu: the stacks wait pinned
    assert plan.host_ram_bytes == plan.offloaded_bytes + CUDA_HOST_BASELINE
    assert plan.disk_bytes == 0


def test_disk_pins_only_the_staging_buffers_and_reads_the_files(tiny: ModelSpec) -> None:
    plan = plan_offload(tiny, cfg("disk"), "H100-80GB")
    assert plan.pinned_host_bytes == 2 * plan.layer_expert_bytes
    assert plan.disk_bytes == plan.offloaded_bytes
    assert plan.transfer_bytes_per_s == 3.5e9  # the disk, slower than PCIe 5, sets the pace
    assert plan.device_peak_bytes == plan_offload(tiny, cfg("cpu"), "H100-80GB").device_peak_bytes


def test_disk_reads_a_bf16_file_as_bf16_when_it_computes_in_fp32(tiny: ModelSpec) -> None:
    # measured (benchmarks/offload_disk.py): a bf16 checkpoint computed in fp32 reads 2 bytes
    # a parameter from the files and holds 4 on the device
    run = parse_config({**cfg("disk").model_dump(), "model": {"dtype": "float32"}})
    plan = plan_offload(tiny, run, "H100-80GB")
    stored = 4 * 3 * 32 * 64 * 4  # the streamed layer in fp32
    assert tiny.dtype == "bfloat16" and plan.layer_expert_bytes == stored
    assert plan.device_components["streamed_experts"] == 2 * stored
    assert plan.bytes_moved_per_step["forward"] == 4 * stored // 2
    assert plan.disk_bytes == 4 * stored // 2
    fp32_cpu = parse_config({**cfg("cpu").model_dump(), "model": {"dtype": "float32"}})
    cpu = plan_offload(tiny, fp32_cpu, "H100-80GB")
    assert cpu.bytes_moved_per_step["forward"] == 4 * stored  # host copies move as stored


def test_a_cpu_device_is_host_ram_and_its_peak_is_the_process(tiny: ModelSpec) -> None:
    run = cfg("cpu", device="cpu")
    fp32 = run.model_copy(update={"model": run.model.model_copy(update={"dtype": "float32"})})
    frozen = analytic(tiny, fp32).components["frozen_weights"]  # a CPU computes fp32
    plan = plan_offload(tiny, run, "H100-80GB")  # train.device cpu wins over the card
    assert plan.card == "cpu" and plan.fits is (plan.device_peak_bytes <= plan.usable_bytes)
    parts = plan.device_components
    assert parts["resident_weights"] == frozen  # cpu offload on a CPU: the stacks live there
    assert parts["process_baseline"] == CPU_PROCESS_BASELINE and "overhead" not in parts
    assert plan.host_ram_bytes == plan.device_peak_bytes
    disk = plan_offload(tiny, cfg("disk"), None)
    assert disk.device_components["resident_weights"] == frozen - disk.offloaded_bytes
    assert disk.device_peak_bytes == plan.device_peak_bytes - disk.offloaded_bytes
    assert disk.pinned_host_bytes == 0 and disk.host_link.id == "host-memcpy"


def test_quantised_experts_move_their_quantised_bytes(tiny: ModelSpec) -> None:
    bf16 = plan_offload(tiny, cfg(), "H100-80GB").layer_expert_bytes
    raw = {
        "model": {"experts_dtype": "nf4", "experts_double_quant": True},
        "lora": {"rank": 4, "engine": "moetune"},
        "train": {"seq_len": 64, "offload": "cpu"},
    }
    nf4 = plan_offload(tiny, parse_config(raw), "H100-80GB").layer_expert_bytes
    assert 3.5 < bf16 / nf4 < 4.0  # 4 bits + scales against 16 bits


def test_host_ram_comes_from_the_config_else_the_cards_node(tiny: ModelSpec) -> None:
    assert plan_offload(tiny, cfg(), "GH200-144GB").host_ram_available_bytes == 480e9
    raw = cfg().model_dump()
    raw["hardware"]["host_ram_gb"] = 64
    assert plan_offload(tiny, parse_config(raw), "H100-80GB").host_ram_available_bytes == 64e9


@pytest.mark.parametrize(
    ("change", "card", "says"),
    [
        ({"train": {"offload": "none"}}, "H100-80GB", "no offload to plan"),
        ({"train": {"offload": "cpu", "tuning": "full"}}, "H100-80GB", "full fine-tuning"),
        ({"train": {"offload": "cpu"}, "model": {"format": "gguf"}}, "H100-80GB", "GGUF"),
        ({"train": {"offload": "cpu"}}, "DGX-Spark", "unified memory"),
    ],
)
def test_what_cannot_offload_is_refused_in_one_line(
    tiny: ModelSpec, change: dict[str, Any], card: str, says: str
) -> None:
    with pytest.raises(ConfigError) as err:
        plan_offload(tiny, parse_config(change), card)
    assert says in err.value.cause and err.value.fix


def test_per_card_plans_skip_unified_memory_unless_it_is_all_there_is(tiny: ModelSpec) -> None:
    plans = offload_plans(tiny, cfg(), ["DGX-Spark", "RTX-4090", "M3-Max-128GB"])
    assert list(plans) == ["RTX-4090"]
    with pytest.raises(ConfigError, match="unified memory"):
        offload_plans(tiny, cfg(), ["DGX-Spark"])
    assert list(offload_plans(tiny, cfg(device="cpu"), ["DGX-Spark"])) == ["cpu"]


def test_a_dense_model_has_nothing_to_offload() -> None:
    dense = spec_from_config(shrunk_config("llama"), "llama")
    with pytest.raises(ConfigError, match="no routed experts"):
        plan_offload(dense, cfg(), "H100-80GB")


def test_qwen3_235b_on_one_h100_and_one_gh200(qwen235b: ModelSpec) -> None:
    run = parse_config({"lora": {"rank": 16}, "train": {"offload": "cpu"}})
    h100 = plan_offload(qwen235b, run, "H100-80GB")
    experts = qwen235b.components.routed_experts * 2
    assert h100.offloaded_bytes == pytest.approx(experts, rel=1e-6)
    assert 400 * GiB < h100.pinned_host_bytes < 450 * GiB  # 423 GiB of bf16 expert stacks
    assert h100.fits and h100.device_peak_bytes < get_card("H100-80GB").usable_bytes
    assert h100.bound == "transfer"  # PCIe 5 carries 3 × 423 GiB per 2k-token step
    gh200 = plan_offload(qwen235b, run, "GH200-144GB")
    assert gh200.fits and gh200.host_ram_fits and gh200.bound == "compute"  # C2C 9× PCIe 5
    assert gh200.tokens_per_s > 3 * h100.tokens_per_s


def test_the_plan_offers_offload_only_where_nothing_else_fits(qwen235b: ModelSpec) -> None:
    plan = make_plan(qwen235b, parse_config({"lora": {"rank": 16}}),
                     cards=["H100-80GB", "B200", "DGX-Spark"])  # fmt: skip
    h100 = plan.best["H100-80GB"]
    assert h100.fits and h100.overrides == ("train.offload=cpu",) and h100.tokens_per_s
    assert not any("train.offload" in o for o in plan.best["B200"].overrides)  # NF4 fits it
    spark = plan.best["DGX-Spark"]
    assert not spark.fits and "unified memory" in spark.notes[0]


def test_offload_keeps_existing_recommendations_where_something_fits(tiny: ModelSpec) -> None:
    plan = make_plan(tiny, cfg("none"), cards=["RTX-4090"])
    assert plan.best["RTX-4090"].changes == ()  # a tiny model fits as is


def test_cli_plan_offload_json_and_table() -> None:
    runner = CliRunner()
    args = ["plan", "Qwen/Qwen3-235B-A22B", "--rank", "16", "--card", "H100-80GB"]
    done = runner.invoke(app, [*args, "--offload", "cpu", "--host-ram", "512", "--json"])
    assert done.exit_code == 0, done.output
    doc = json.loads(done.output)["offload"]["H100-80GB"]
    assert doc["offload"] == "cpu" and doc["host_ram_available_bytes"] == 512e9
    assert doc["step_time_s"] == max(doc["compute_s"], doc["transfer_s"])
    assert set(doc["bytes_moved_per_step"]) == {"forward", "recompute", "backward"}
    table = runner.invoke(app, [*args, "--offload", "disk"], env={"COLUMNS": "220"})
    assert table.exit_code == 0, table.output
    assert "offload disk" in table.output and "streamed_experts" in table.output
    assert "balance tok" in table.output
