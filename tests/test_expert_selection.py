"""ESFT-style expert selection (train/routing/select.py): the selection math, scores on routers
whose choice is known, gradient masks on both engines, and `train()` end to end.

Layouts are checked independently of select.py's masks: peft keeps lora_A [r·E, in] as
(E, r, in) and lora_B [out, r·E] as (out, r, E), expert index fastest.
"""

from __future__ import annotations

import copy
import itertools
import json
import types
from pathlib import Path

import pytest
import torch

from moetune.engine import apply_split_lora, experts_lora
from moetune.errors import ConfigError
from moetune.model import load_spec, spec_from_config
from moetune.model.tiny import tiny_config
from moetune.train import train
from moetune.train.routing.recorder import routed_weights
from moetune.train.routing.select import (
    ExpertSelection,
    LayerChoice,
    choose,
    expert_wrappers,
    mean_gate,
    pick,
    restrict_training,
    score_experts,
    token_share,
)
from test_engine_experts_lora import _ids, _peft, _rel, _step
from test_train_helpers import one_thread, reverse_rows, run_config, save_tiny_model, write_jsonl

pytestmark = pytest.mark.filterwarnings("ignore")


# ---------------------------------------------------------------- the selection math


@pytest.mark.parametrize(
    ("scores", "share", "chosen", "covered"),
    [
        ([0.1, 0.5, 0.3, 0.1], 0.5, [1], 0.5),
        ([0.1, 0.5, 0.3, 0.1], 0.6, [1, 2], 0.8),
        ([0.1, 0.5, 0.3, 0.1], 1.0, [0, 1, 2, 3], 1.0),
        ([2.0, 6.0, 0.0, 2.0], 0.6, [1], 0.6),  # shares of the layer's total, not raw scores
        ([2.0, 6.0, 0.0, 2.0], 0.7, [0, 1], 0.8),  # tie between 0 and 3: the lower id
        ([1.0, 1.0, 1.0, 1.0], 0.5, [0, 1], 0.5),  # boundary reached exactly: stop there
        ([1.0, 1.0, 1.0, 1.0], 0.3, [0, 1], 0.5),
        ([0.2, 0.1, 0.7], 0.9, [0, 2], 0.9),  # 0.7 + 0.2 = 0.8999…: reached, not short
        ([0.3, 0.7, 0.0], 1e-6, [1], 0.7),  # at least one: the top expert
        ([0.0, 0.0, 0.0], 0.2, [0], 0.0),  # nothing routed: still one
    ],
)
def test_pick(scores, share, chosen, covered):
    got, got_covered = pick(scores, share)
    assert got == chosen
    assert got_covered == pytest.approx(covered)


def test_choose_per_layer_and_json_round_trip():
    table = {3: [0.1, 0.5, 0.3, 0.1], 1: [0.7, 0.1, 0.1, 0.1]}
    scores = {k: torch.tensor(v, dtype=torch.float64) for k, v in table.items()}  # as scored
    selection = choose(scores, "token", 0.6, rows=5, tokens=40)
    assert [c.layer for c in selection.layers] == [1, 3]
    assert [c.selected for c in selection.layers] == [(0,), (1, 2)]
    assert selection.keep(3).tolist() == [False, True, True, False]
    assert selection.summary() == {
        "mode": "token", "target_share": 0.6, "rows": 5, "tokens": 40,
        "trained_experts": 3, "total_experts": 8, "selected": {"1": [0], "3": [1, 2]},
    }  # fmt: skip
    data = json.loads(json.dumps(selection.to_json()))
    assert data["layers"]["3"] == {"selected": [1, 2], "scores": [0.1, 0.5, 0.3, 0.1], "share": 0.8}
    assert ExpertSelection.from_json(data).summary() == selection.summary()


def test_scores_by_hand():
    indices = torch.tensor([[1, 3], [1, 2]])
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4]])
    assert token_share(indices, weights, 4).tolist() == [0.0, 0.5, 0.25, 0.25]
    gate = mean_gate(indices, weights, 4)
    torch.testing.assert_close(gate, torch.tensor([0.0, 0.65, 0.2, 0.15], dtype=torch.float64))
    assert token_share(indices, None, 4).tolist() == [0.0, 0.5, 0.25, 0.25]
    with pytest.raises(experts_lora.EngineError, match="no routing weights"):
        mean_gate(indices, None, 4)  # a router output without scores


def test_routing_weights_read_from_the_router_output():
    logits = torch.tensor([[0.0, 2.0, 1.0, 0.0]])
    indices = torch.tensor([[1, 2]])
    weights = torch.tensor([[0.9, 0.1]])
    assert torch.equal(routed_weights((logits, weights, indices), indices), weights)
    from_logits = routed_weights(logits, indices)  # a router that returns only logits
    torch.testing.assert_close(from_logits, logits.softmax(-1)[:, [1, 2]])
    assert routed_weights((indices,), indices) is None


# ---------------------------------------------------------------- scores on known routing

# gpt_oss routers have a bias: with a zero weight, every token goes to the two experts with
# the largest bias, weighted softmax(top-2 bias)
BIAS = {0: [0.0, 5.0, 0.0, 3.0], 1: [4.0, 0.0, 2.0, 0.0], 2: [0.0, 1.0, 6.0, 0.0]}


@pytest.fixture(scope="module")
def known():
    model = _peft("gpt_oss")
    spec = spec_from_config(tiny_config("gpt_oss"))
    with torch.no_grad():
        for layer, bias in BIAS.items():
            router = model.get_base_model().model.layers[layer].mlp.router
            router.weight.zero_()
            router.bias.copy_(torch.tensor(bias))
    ids = _ids(batch=2, seq=12)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # three padding tokens: not scored
    return types.SimpleNamespace(
        model=model, spec=spec, batch={"input_ids": ids, "attention_mask": mask}
    )


def test_gate_scores_pick_the_favoured_experts(known):
    scores, tokens = score_experts(known.model, known.spec, [known.batch], "gate")
    assert tokens == 21
    for layer, bias in BIAS.items():
        top = sorted(range(4), key=lambda e: -bias[e])[:2]
        w = torch.tensor([bias[e] for e in top]).softmax(0)
        expected = torch.zeros(4, dtype=torch.float64)
        expected[top] = w.double()
        torch.testing.assert_close(scores[layer], expected, atol=1e-6, rtol=0)
    selection = choose(scores, "gate", 0.6, rows=2, tokens=tokens)
    # the first favourite alone holds ≥ 0.6 of the gate weight (softmax of a gap of >= 2)
    assert [c.selected for c in selection.layers] == [(1,), (0,), (2,)]


def test_token_scores_split_evenly_over_the_routed_pair(known):
    known.model.train()
    scores, _ = score_experts(known.model, known.spec, [known.batch], "token")
    assert known.model.training  # scored in eval mode, the mode restored
    selection = choose(scores, "token", 0.6, rows=2, tokens=21)
    assert [c.selected for c in selection.layers] == [(1, 3), (0, 2), (1, 2)]
    assert all(c.share == 1.0 for c in selection.layers)
    assert scores[0].tolist() == [0.0, 0.5, 0.0, 0.5]


# ---------------------------------------------------------------- training only the selected

SPEC = spec_from_config(tiny_config("qwen3_moe-dense0"))  # MoE layers 1 and 2, 4 experts
CHOSEN = {1: (1,), 2: (0, 3)}


def _selection(chosen: dict[int, tuple[int, ...]] = CHOSEN) -> ExpertSelection:
    layers = tuple(LayerChoice(k, v, (0.25,) * 4, 0.5) for k, v in chosen.items())
    return ExpertSelection("gate", 0.5, 1, 1, 4, layers)


def _b_slice(wrapper, e: int) -> torch.Tensor:
    b = wrapper.lora_B["default"].weight
    return b.view(b.shape[0], -1, wrapper.num_experts)[:, :, e]  # (out, r, E): expert fastest


def _a_slice(wrapper, e: int) -> torch.Tensor:
    a = wrapper.lora_A["default"].weight
    return a.view(wrapper.num_experts, -1, a.shape[-1])[e]  # (E, r, in): expert-major


def _zero_unselected_b(model) -> None:
    with torch.no_grad():
        for layer, wrappers in expert_wrappers(model, SPEC).items():
            for w in wrappers:
                for e in set(range(4)) - set(CHOSEN[layer]):
                    _b_slice(w, e).zero_()


def _delta(wrapper) -> torch.Tensor:
    with torch.no_grad():
        return wrapper.get_delta_weight("default").clone()  # [E, ...]


def test_nonzero_lora_b_is_refused():
    with pytest.raises(experts_lora.EngineError, match="lora_B initialised to zero"):
        restrict_training(_peft(), SPEC, _selection())  # _peft draws B at random


@pytest.mark.parametrize("engine", ["peft", "moetune"])
def test_only_selected_experts_train(engine):
    model = _peft()  # selected experts keep a random B, so their ΔW starts non-zero
    _zero_unselected_b(model)
    if engine == "moetune":
        apply_split_lora(model)
    restrict_training(model, SPEC, _selection())
    wrappers = expert_wrappers(model, SPEC)
    assert {k: len(v) for k, v in wrappers.items()} == {1: 2, 2: 2}  # gate_up and down
    before = {id(w): (_delta(w), w.lora_A["default"].weight.detach().clone())
              for ws in wrappers.values() for w in ws}  # fmt: skip
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)  # decay must not move B
    for seed in range(3):
        ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(seed))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    for layer, ws in wrappers.items():
        for w, e in itertools.product(ws, range(4)):
            delta_before, a_before = before[id(w)]
            delta = _delta(w)[e]
            if e in CHOSEN[layer]:
                assert _rel(delta, delta_before[e]) > 1e-3, (layer, e)
                continue
            assert torch.count_nonzero(delta) == 0, (layer, e)  # ΔW exactly zero
            assert torch.count_nonzero(_b_slice(w, e)) == 0
            # no gradient, only AdamW's decoupled decay (3 steps): A shrinks in place
            a_e = a_before.view(4, -1, a_before.shape[-1])[e]
            torch.testing.assert_close(_a_slice(w, e).detach(), a_e * (1 - 1e-2 * 0.1) ** 3)


def test_split_engine_skips_unselected_and_matches_peft_masks():
    stock = _peft()
    _zero_unselected_b(stock)
    split = copy.deepcopy(stock)
    apply_split_lora(split)
    for model in (stock, split):
        restrict_training(model, SPEC, _selection())
    experts = [w.get_base_layer() for ws in expert_wrappers(split, SPEC).values() for w in ws]
    assert all(experts_lora._KEEP in e.__dict__ for e in experts)
    ids = _ids()
    (loss_ref, grads_ref), (loss, grads) = _step(stock, ids), _step(split, ids)
    assert _rel(loss, loss_ref) <= 1e-5
    for name, grad in grads.items():
        assert _rel(grad, grads_ref[name]) <= 1e-5, name
    for layer, ws in expert_wrappers(split, SPEC).items():
        for w in ws:
            g_b = w.lora_B["default"].weight.grad
            g_a = w.lora_A["default"].weight.grad
            g_b = g_b.view(g_b.shape[0], -1, 4)
            g_a = g_a.view(4, -1, g_a.shape[-1])
            for e in range(4):
                zero = e not in CHOSEN[layer]
                assert (torch.count_nonzero(g_b[:, :, e]) == 0) == zero, (layer, e)
                assert (torch.count_nonzero(g_a[e]) == 0) == zero, (layer, e)
    # the split path does not compute the unselected experts' LoRA at all: a non-zero B
    # there (which selection never lets happen) changes peft's output, not the split one
    with torch.no_grad():
        ref_split, ref_stock = split(input_ids=ids).logits, stock(input_ids=ids).logits
        for model in (stock, split):
            for layer, ws in expert_wrappers(model, SPEC).items():
                for w in ws:
                    _b_slice(w, 2 if layer == 1 else 1).fill_(0.5)
        assert torch.equal(split(input_ids=ids).logits, ref_split)
        assert _rel(stock(input_ids=ids).logits, ref_stock) > 1e-3


# ---------------------------------------------------------------- train() end to end


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("select")
    model = save_tiny_model(root / "model")
    data = write_jsonl(root / "train.jsonl", reverse_rows(24))
    return types.SimpleNamespace(root=root, model=model, data=data)


def _json(path: Path):
    return json.loads(path.read_text())


@pytest.mark.parametrize(("engine", "mode"), [("peft", "gate"), ("moetune", "token")])
def test_train_with_selection(files, engine, mode):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = files.root / f"run-{engine}"
    cfg = run_config(
        files.model, files.data, out, max_steps=3, save_steps=50, routing_every=0,
        weight_decay=0.1, lora__engine=engine, lora__expert_selection=mode,
        lora__expert_selection_share=0.4, lora__expert_selection_rows=8,
    )  # fmt: skip
    with one_thread():
        result = train(cfg, progress=False)
    assert result.steps == 3 and not result.warnings
    chosen = _json(out / "experts_selected.json")
    assert (chosen["mode"], chosen["target_share"], chosen["rows"]) == (mode, 0.4, 8)
    assert 8 * 3 < chosen["tokens"] <= 8 * 32  # real tokens of 8 rows, no padding
    assert set(chosen["layers"]) == {"0", "1"}
    for layer in chosen["layers"].values():
        assert len(layer["scores"]) == 4
        assert layer["selected"] == pick(layer["scores"], 0.4)[0]
        assert 0.4 <= layer["share"] <= 1.0 and 1 <= len(layer["selected"]) <= 2  # top-2 of 4
        total = sum(layer["scores"])
        assert total == pytest.approx(1.0) if mode == "token" else 0.5 < total < 1.0
    summary = _json(out / "summary.json")["expert_selection"]
    selected = {k: v["selected"] for k, v in chosen["layers"].items()}
    assert summary["selected"] == selected and summary["total_experts"] == 8
    assert summary["trained_experts"] == sum(len(v) for v in selected.values())
    # the adapter, loaded with plain peft: unselected experts' ΔW exactly zero
    base = AutoModelForCausalLM.from_pretrained(files.model, dtype=torch.float32)
    spec = load_spec(str(files.model))
    loaded = PeftModel.from_pretrained(base, result.adapter_dir)
    for layer, ws in expert_wrappers(loaded, spec).items():
        assert len(ws) == 2
        for w in ws:
            delta = _delta(w)
            for e in range(4):
                trained = e in selected[str(layer)]
                assert (torch.count_nonzero(delta[e]) > 0) == trained, (layer, e)


def test_selection_refuses_a_trained_router_or_no_expert_targets(files, tmp_path):
    cases = {
        "lora.train_router": dict(lora__train_router=True),
        "lora.targets has no experts": dict(lora__targets=["attention"]),
    }
    for i, (cause, over) in enumerate(cases.items()):
        out = tmp_path / f"bad{i}"
        cfg = run_config(files.model, files.data, out, lora__expert_selection="gate", **over)
        with pytest.raises(ConfigError, match=cause) as info:
            train(cfg, progress=False)
        assert "lora.expert_selection: all" in info.value.fix
        assert not out.exists()  # refused before anything was written
