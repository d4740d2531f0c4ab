"""`plan --gpus G --nodes M --strategy ep`: each rank's step time with its all-to-all volume
over the links it crosses (NVLink inside a node, the inter-node network between nodes), and
host RAM per node with the experts split over every node's ranks."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import RunConfig, dump_config, parse_config
from moetune.model import load_spec
from moetune.model.spec import ModelSpec
from moetune.plan.devices.ep_step import ep_step_time
from moetune.plan.devices.host_ram import RUNTIME_HOST_BYTES, host_ram
from moetune.plan.devices.sharding import run_sizes
from moetune.plan.hardware import get_card

# Qwen3-30B-A3B: 48 MoE layers, top-8, hidden 2048; bf16 hidden states
COPY = 4096 * 8 * 2048 * 2  # one exchange's token copies at seq 4096, batch 1


@pytest.fixture(scope="module")
def qwen() -> ModelSpec:
    return load_spec("Qwen/Qwen3-30B-A3B")


def cfg(**train: Any) -> RunConfig:
    lora = {"rank": 16, "targets": ["attention", "experts"]}
    return parse_config({"lora": lora, "train": {"seq_len": 4096, **train}})


def test_the_all_to_all_volume_is_every_layers_exchanges(qwen: ModelSpec) -> None:
    """Dispatch + combine, their backward and the recompute: 6 exchanges a MoE layer (4
    without checkpointing); 7/8 of a rank's copies leave it on one node of 8."""
    h100 = get_card("H100-80GB")
    one = ep_step_time(qwen, cfg(), h100, 8)
    assert one.exchanges == 6 * 48 and one.copy_bytes == COPY
    assert one.intra_node_bytes == 6 * 48 * COPY * 7 // 8 and one.inter_node_bytes == 0
    assert one.all_to_all_s == pytest.approx(one.intra_node_bytes / 450e9)
    plain = ep_step_time(qwen, cfg(gradient_checkpointing=False), h100, 8)
    assert plain.exchanges == 4 * 48
    assert plain.compute_s is not None and one.compute_s is not None
    assert plain.compute_s == pytest.approx(one.compute_s * 4 / 6)  # no recompute


def test_a_second_node_moves_half_the_copies_over_the_network(qwen: ModelSpec) -> None:
    """2 nodes × 8 H100: each rank keeps 1/16, sends 7/16 over NVLink (450 GB/s) and 8/16 over
    its 400 Gb/s NIC (50 GB/s) – the slower link sets the exchange time, 5.1× one node's;
    compute per rank is unchanged (its own micro-batch)."""
    h100 = get_card("H100-80GB")
    one = ep_step_time(qwen, cfg(), h100, 8)
    two = ep_step_time(qwen, cfg(), h100, 8, nodes=2)
    n = 6 * 48 * COPY
    assert (two.intra_node_bytes, two.inter_node_bytes) == (n * 7 // 16, n * 8 // 16)
    assert two.all_to_all_s == pytest.approx(n / 2 / 50e9)
    assert two.all_to_all_s / one.all_to_all_s == pytest.approx((8 / 16 / 50) / (7 / 8 / 450))
    assert two.compute_s == one.compute_s
    assert two.step_s is not None and one.step_s is not None and two.step_s > one.step_s


def test_expert_groups_exchange_within_their_group(qwen: ModelSpec) -> None:
    """train.ep_degree 8 on 2 nodes × 8 H100: each all-to-all spans one group of 8 ranks on
    one node – 7/8 of the copies over NVLink, none over the network (one node's figure);
    groups of 16 span both nodes as ep over every rank does."""
    h100 = get_card("H100-80GB")
    n = 6 * 48 * COPY
    grouped = ep_step_time(qwen, cfg(ep_degree=8), h100, 8, nodes=2)
    assert (grouped.intra_node_bytes, grouped.inter_node_bytes) == (n * 7 // 8, 0)
    assert grouped.node_link is None and grouped.group == 8
    assert grouped.all_to_all_s == ep_step_time(qwen, cfg(), h100, 8).all_to_all_s
    assert "groups of 8" in grouped.describe()
    wide = ep_step_time(qwen, cfg(ep_degree=16), h100, 8, nodes=2)
    assert (wide.intra_node_bytes, wide.inter_node_bytes) == (n * 7 // 16, n * 8 // 16)


def test_a_pcie_card_exchanges_over_its_host_link(qwen: ModelSpec) -> None:
    """L40S (no NVLink): PCIe 4.0 at 25 GB/s inside the node; between nodes one 100 GbE
    port shared by the node's 4 GPUs."""
    card = get_card("L40S")
    two = ep_step_time(qwen, cfg(), card, 4, nodes=2)
    assert two.gpu_link.gb_per_s == 25 and two.node_link is not None
    assert two.node_link.gb_per_s == 12.5 / 4
    assert two.all_to_all_s == pytest.approx(two.inter_node_bytes / (12.5e9 / 4))


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Any:
    """A small Qwen3-MoE's config (16 experts, hidden 64) and its run.yaml."""
    from test_train_helpers import write_small_moe_config

    model = write_small_moe_config(tmp_path_factory.mktemp("ep-nodes") / "model")
    run = cfg(seq_len=256)
    run.model.id = str(model)
    config = model.parent / "run.yaml"
    config.write_text(dump_config(run))
    return config, run, load_spec(str(model))


def test_every_cards_links_are_finite(qwen: ModelSpec) -> None:
    """A unified-memory machine (one device) exchanges over the network: no card's step
    is infinite or unknown where its tensor peak is known."""
    from moetune.plan.hardware import all_cards

    for card in all_cards():
        step = ep_step_time(qwen, cfg(), card, 2, nodes=2)
        assert 0 < step.all_to_all_s < 60 and json.dumps(step.to_json(), allow_nan=False)


def test_host_ram_per_node_reads_1_over_every_ranks_experts(small: Any) -> None:
    """A node of 8 ranks out of 16 reads 1/16 of the experts per rank, not 1/8: the
    second node takes half of each rank's expert bytes off the first."""
    _, run, spec = small
    sizes = run_sizes(spec, run)
    one, two = host_ram(sizes, 8, "ep"), host_ram(sizes, 8, "ep", world=16)
    rest = sizes.single["frozen_weights"] + sizes.single["trainable_weights"] - sizes.expert_weights
    assert one.per_node_bytes == 8 * (RUNTIME_HOST_BYTES + rest + -(-sizes.expert_weights // 8))
    assert two.per_node_bytes == 8 * (RUNTIME_HOST_BYTES + rest + -(-sizes.expert_weights // 16))
    saved = one.per_node_bytes - two.per_node_bytes
    assert saved == pytest.approx(8 * sizes.expert_weights / 16, abs=16)
    # train.ep_degree 4: a rank reads its group's share, E/4, whatever the world
    grouped = host_ram(dataclasses.replace(sizes, ep_degree=4), 8, "ep", world=16)
    assert grouped.per_node_bytes == 8 * (RUNTIME_HOST_BYTES + rest + -(-sizes.expert_weights // 4))


def test_plan_json_gives_each_cards_ep_step(small: Any) -> None:
    config, run, spec = small
    args = ["plan", str(config), "--gpus", "8", "--nodes", "2", "--strategy", "ep", "--json"]
    got = CliRunner().invoke(app, [*args, "--card", "H100-80GB"])
    assert got.exit_code == 0, got.output
    devices = json.loads(got.output)["devices"]
    step = devices["ep_step_time"]["H100-80GB"]
    assert (step["nodes"], step["ranks"], step["node_link"]["gb_per_s"]) == (2, 16, 50.0)
    assert step["step_s"] == pytest.approx(step["compute_s"] + step["all_to_all_s"])
    assert any("between nodes" in n for n in devices["notes"])
    ram = devices["host_ram"]  # this node's 8 ranks, each reading 1/16 of the experts
    want = host_ram(run_sizes(spec, run), 8, "ep", world=16)
    assert ram["per_node_bytes"] == want.per_node_bytes
