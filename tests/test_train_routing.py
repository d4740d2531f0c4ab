"""Routing diagnostics: numbers on hand-made routings, and the hooks on a real tiny MoE."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from moetune.model import load_spec
from moetune.train.routing.recorder import (
    LayerLoad,
    RoutingCallback,
    RoutingRecorder,
    drifted,
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
    (warning,) = callback.warnings  # collapsed at both records: said once for the layer
    assert "layer 0" in warning and "expert 1" in warning and "75%" in warning


def _steps(callback, steps: int) -> None:
    args = SimpleNamespace(should_save=False)
    for step in range(steps):
        state = SimpleNamespace(global_step=step)
        callback.on_step_begin(args, state, None)
        state.global_step += 1
        callback.on_step_end(args, state, None)


def _layer(layer: int, rows: list[list[int]]) -> LayerLoad:
    return layer_load(layer, torch.tensor(rows), 4)


def test_drift_is_judged_against_the_base_once_per_layer():
    concentrated = [[1, 0]] * 60 + [[2, 3]] * 20  # 75 % of first choices to expert 1
    spread = [[e, (e + 1) % 4] for e in range(4)] * 20  # 25 % each
    base = {0: _layer(0, concentrated), 1: _layer(1, spread)}
    # layer 0 stays as concentrated as the base already was; layer 1 collapses
    fake = _FakeRecorder([_layer(0, concentrated), _layer(1, concentrated)])
    callback = RoutingCallback(fake, 1, lambda row: None, base=base)  # type: ignore[arg-type]
    _steps(callback, 5)
    (warning,) = callback.warnings
    assert warning.startswith("routing collapse at step 1: layer 1 sends 75% of tokens")
    assert "base 25%" in warning
    drift = callback.drift()
    assert drift["drifted_layers"] == [1] and [b["layer"] for b in drift["base"]] == [0, 1]
    assert drift["line"] == (
        "routing: 1 of 2 layers drifted from the base (collapsed and > 10% above the base's "
        "top-1 share): layers 1; base already concentrated in layer 0 (75% to expert 1)"
    )


def test_within_the_margin_is_not_drift():
    base = _layer(0, [[1, 0]] * 53 + [[2, 3]] * 47)  # 53 %: the quickstart's layer 2
    assert not drifted(_layer(0, [[1, 0]] * 60 + [[2, 3]] * 40), base)  # +7 pp
    assert drifted(_layer(0, [[1, 0]] * 90 + [[2, 3]] * 10), base)  # +37 pp
    assert not drifted(_layer(0, [[1, 0]] * 40 + [[2, 3]] * 30 + [[3, 2]] * 30), None)
    assert drifted(_layer(0, [[1, 0]] * 60 + [[2, 3]] * 40), None)  # no base: plain collapse


# ---------------------------------------------------------------- hooks on a real model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(tmp_path_factory.mktemp("routing") / "model")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, load_spec(str(path))


def test_recording_a_scores_only_router_saves_nothing_for_backward(tiny):
    """llama4's router returns scores and logits only, read through their top-k: done with
    autograd on, the top-k saved its indices inside the checkpointed layer and backward
    failed (86 tensors saved in forward, 85 in the recompute)."""
    model, spec = tiny
    recorder = RoutingRecorder(model, spec, weights=True)
    scores = torch.tensor([[0.1, 0.9, 0.0, 0.5], [2.0, 0.0, 1.0, 0.0]], requires_grad=True)
    packed: list[torch.Tensor] = []
    recorder.start()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        recorder.record(0, (scores.sigmoid(), scores * 1.0))
    indices, weights = recorder.routed()[0]
    recorder.remove()
    assert len(packed) == 1  # sigmoid's own output; the recording added none
    assert indices.tolist() == [[1, 3], [0, 2]] and not indices.requires_grad
    assert weights is not None and not weights.requires_grad
    expected = scores.detach().sigmoid().softmax(-1).gather(1, indices)  # the first floats
    assert torch.allclose(weights, expected)


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


def test_a_run_measures_the_base_and_never_warns_where_routing_equals_it(tmp_path):
    """LoRA on the experts only: layer 0's router sees what the base's saw, and every step
    trains on all 8 rows, so its records equal the base's measurement token for token."""
    import json

    from moetune.train import train
    from test_train_helpers import reverse_rows, run_config, write_jsonl

    model = save_tiny_model(tmp_path / "model")
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    cfg = run_config(
        model, data, tmp_path / "run", max_steps=3, batch_size=8, routing_every=1,
        save_steps=50, lora__targets=["experts"],
    )  # fmt: skip
    with one_thread():
        result = train(cfg, progress=False)
    routing = json.loads((tmp_path / "run" / "summary.json").read_text())["routing"]
    base = {b["layer"]: b for b in routing["base"]}
    assert sorted(base) == [0, 1] and base[0]["tokens"] > 0
    records = [json.loads(line) for line in (tmp_path / "run" / "routing.jsonl").open()]
    assert len(records) == 3
    for record in records:
        layer0 = record["layers"][0]
        assert layer0["tokens_per_expert"] == base[0]["tokens_per_expert"]
    collapse = [w for w in result.warnings if w.startswith("routing collapse")]
    assert len(collapse) <= 2 and not any("layer 0 " in w for w in collapse)
    assert len({w.split("layer ")[1].split()[0] for w in collapse}) == len(collapse)
    assert 0 not in routing["drifted_layers"]
    assert routing["line"].startswith(f"routing: {len(collapse)} of 2 layers drifted")
