"""Routing diagnostics: numbers on hand-made routings, and the hooks on a real tiny MoE."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from moetune.model import load_spec
from moetune.train.routing import (
    LayerLoad,
    RoutingCallback,
    RoutingRecorder,
    layer_load,
    routed_experts,
    router_modules,
    summarize,
)
from test_train_helpers import one_thread, save_tiny_model


def _load(rows: list[list[int]], experts: int = 4) -> LayerLoad:
    return layer_load(0, torch.tensor(rows), experts)


def test_all_tokens_to_one_expert_is_a_collapse():
    load = _load([[0]] * 10)
    assert load.counts == (10, 0, 0, 0)
    assert load.entropy == 0.0
    assert (max(load.fractions), min(load.fractions)) == (1.0, 0.0)
    assert load.dead == (1, 2, 3)
    assert load.top1_share == 1.0 and load.busiest == 0
    assert load.collapsed


def test_even_top2_routing_has_entropy_one():
    load = _load([[0, 1], [2, 3], [1, 0], [3, 2]])
    assert load.counts == (2, 2, 2, 2)
    assert load.entropy == pytest.approx(1.0)
    assert load.fractions == (0.25,) * 4
    assert load.dead == ()
    assert load.top1_share == 0.25 and not load.collapsed


def test_top2_numbers_by_hand():
    # 4 tokens, top-2: expert 0 first choice of 3 tokens -> 75 % > 50 %: collapse
    load = _load([[0, 1], [0, 2], [0, 1], [1, 0]])
    assert load.counts == (4, 3, 1, 0)
    assert load.top1 == (3, 1, 0, 0)
    p = [4 / 8, 3 / 8, 1 / 8]
    assert load.entropy == pytest.approx(-sum(x * math.log(x) for x in p) / math.log(4))
    assert load.to_json()["max_fraction"] == 0.5
    assert load.to_json()["dead_experts"] == [3]
    assert load.collapsed
    assert not _load([[0, 1], [1, 0], [2, 0], [3, 1]]).collapsed  # first choices spread


def test_router_outputs_are_read_as_indices_or_logits():
    logits = torch.tensor([[0.1, 0.9, 0.0, 0.5], [2.0, 0.0, 1.0, 0.0]])
    indices = torch.tensor([[3, 1], [0, 2]])
    assert torch.equal(routed_experts((logits, logits, indices), 4, 2), indices)
    assert routed_experts(logits, 4, 2).tolist() == [[1, 3], [0, 2]]
    assert routed_experts("nothing", 4, 2) is None


def _records():
    def row(step, first):
        return {"step": step, "layers": [_load([[first, 1]] * 3 + [[2, 3]]).to_json()]}

    return [row(2, 2), row(4, 0)]


def test_summary_condenses_records_per_layer():
    summary = summarize(_records())
    assert summary["records"] == 2
    layer = summary["layers"]["0"]
    assert layer["last_step"] == 4 and layer["collapsed_steps"] == [2, 4]
    assert layer["entropy_min"] <= layer["entropy_mean"] <= max(layer["entropy_last"], 1.0)
    assert layer["dead_experts_last"] == []
    assert summary["collapsed_layers"] == [0]


class _FakeRecorder:
    def __init__(self, loads):
        self.loads, self.active = loads, False

    def start(self):
        self.active = True

    def stop(self):
        self.active = False
        return self.loads


def test_callback_records_every_n_steps_and_warns_on_collapse():
    rows: list[dict] = []
    fake = _FakeRecorder([_load([[1, 0]] * 6 + [[2, 3]] * 2)])
    callback = RoutingCallback(fake, 3, rows.append)  # type: ignore[arg-type]
    args = SimpleNamespace(should_save=True)
    for step in range(6):
        state = SimpleNamespace(global_step=step)
        callback.on_step_begin(args, state, None)
        state.global_step += 1
        callback.on_step_end(args, state, None)
    assert [r["step"] for r in rows] == [3, 6]
    assert rows[0]["layers"][0]["tokens_per_expert"] == [6, 6, 2, 2]
    assert len(callback.warnings) == 2
    assert "layer 0" in callback.warnings[0] and "expert 1" in callback.warnings[0]
    assert "75%" in callback.warnings[0]


# ---------------------------------------------------------------- hooks on a real model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(tmp_path_factory.mktemp("routing") / "model")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, load_spec(str(path))


def test_recorder_counts_real_tokens_once_per_layer(tiny):
    model, spec = tiny
    recorder = RoutingRecorder(model, spec)
    assert sorted(router_modules(model, spec)) == [0, 1]
    ids = torch.randint(4, 40, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0  # two padding tokens
    model.activation_checkpointing_enable()
    model.train()
    with one_thread():
        recorder.start()
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()  # recomputes the checkpointed layers: must not count twice
        loads = recorder.stop()
        model(input_ids=ids, attention_mask=mask)  # not recording any more
    assert [x.layer for x in loads] == [0, 1]
    for load in loads:
        assert load.tokens == 12
        assert sum(load.counts) == 12 * spec.top_k
    assert recorder.stop() == loads  # the forward after stop() added nothing
    recorder.remove()
