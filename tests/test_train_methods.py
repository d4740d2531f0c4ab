"""train.method dpo and grpo end to end on tiny MoEs (qwen3_moe and mixtral, CPU fp32):
coverage, frozen router, the reference policy being the adapter disabled (no second copy),
the rollout → training routing shift, and the refusals before anything is written."""

from __future__ import annotations

import importlib.util
import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from moetune.train import TrainError, train
from moetune.train.errors import DataError
from moetune.train.grpo.shift import ShiftRecorder
from moetune.train.methods import reference_of
from test_train_helpers import WORDS, run_config, save_tiny_model, train_capturing, write_jsonl


def save_tiny_family(out: Path, variant: str) -> Path:
    """A tiny random model of another family, with the demo char tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from moetune.demo.tokenizer import build_tokenizer
    from moetune.model.tiny import tiny_config

    tok = build_tokenizer()
    raw = tiny_config(variant)
    ids = {"pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
           "bos_token_id": tok.bos_token_id}  # fmt: skip
    config = AutoConfig.for_model(**{**raw, "vocab_size": len(tok), **ids})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def preference_rows(n: int) -> list[dict[str, str]]:
    return [
        {"prompt": f"rev:{w}>", "chosen": w[::-1] + "<eos>", "rejected": w + "<eos>"}
        for w in (WORDS * n)[:n]
    ]


def prompt_rows(n: int) -> list[dict[str, str]]:
    return [{"prompt": f"rev:{w}>", "answer": w[::-1]} for w in (WORDS * n)[:n]]


GRPO = {"num_generations": 4, "max_completion_length": 6}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("methods")
    return types.SimpleNamespace(
        root=root,
        qwen=save_tiny_model(root / "qwen"),
        mixtral=save_tiny_family(root / "mixtral", "mixtral"),
        pref=write_jsonl(root / "pref.jsonl", preference_rows(16)),
        prompts=write_jsonl(root / "prompts.jsonl", prompt_rows(16)),
    )


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def dpo(files):
    cfg = run_config(files.qwen, files.pref, files.root / "dpo", method="dpo", max_steps=4)
    return (*train_capturing(cfg), cfg)


@pytest.fixture(scope="module")
def grpo(files):
    cfg = run_config(
        files.qwen, files.prompts, files.root / "grpo", method="grpo", max_steps=4,
        batch_size=8, grpo=GRPO,
    )  # fmt: skip
    if importlib.util.find_spec("tensorboard"):  # the shift reaches the trackers too
        cfg.output.report_to = ["tensorboard"]
    return (*train_capturing(cfg), cfg)


def _base_param_count(model_dir: Path) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())


def test_dpo_trains_every_target_with_a_frozen_router(dpo):
    result, _, cfg = dpo
    assert (result.method, result.steps, result.coverage) == ("dpo", 4, 1.0)
    assert result.router_changed is False and result.aux_loss is False
    run = Path(result.run_dir)
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    metrics = _jsonl(run / "metrics.jsonl")
    assert "reward_margin" in metrics[-1] and "reward_accuracy" in metrics[-1]
    row = _jsonl(Path(cfg.output.ledger))[-1]
    assert (row["kind"], row["status"], row["metrics"]["method"]) == ("train", "ok", "dpo")


def test_dpo_reference_is_the_base_with_the_adapter_disabled_not_a_copy(dpo, files):
    _, trainer, _ = dpo
    model = trainer.model
    assert reference_of(trainer) == "adapter disabled" and trainer.ref_model is None
    assert list(model.peft_config) == ["default"]  # TRL's "ref" adapter copy was never made
    adapter = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    total = sum(p.numel() for p in model.parameters())
    assert total == _base_param_count(files.qwen) + adapter  # one model, one adapter
    # the reference TRL computes (adapter disabled) is the base, though the adapter trained
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(files.qwen).eval()
    ids = torch.tensor([[10, 11, 12, 41, 13]])
    model.eval()
    with torch.no_grad(), model.disable_adapter():
        ref = model(input_ids=ids).logits
    with torch.no_grad():
        torch.testing.assert_close(ref, base(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(model(input_ids=ids).logits, ref, atol=1e-4)


def test_grpo_trains_and_records_the_routing_shift(grpo):
    result, trainer, _ = grpo
    assert (result.method, result.steps, result.coverage) == ("grpo", 4, 1.0)
    assert result.router_changed is False
    assert reference_of(trainer) == "none"  # beta 0: no reference pass at all
    run = Path(result.run_dir)
    rows = _jsonl(run / "routing_shift.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    layers = rows[0]["layers"]
    assert [x["layer"] for x in layers] == [0, 1] and all(x["tokens"] > 0 for x in layers)
    assert all(0.0 <= x["shift"] <= 1.0 for r in rows for x in r["layers"])
    assert all(0.0 <= x["top1_shift"] <= 1.0 for r in rows for x in r["layers"])
    assert all("mean_top1_shift" in r for r in rows)
    logged = {r["step"]: r for r in _jsonl(run / "metrics.jsonl") if "loss" in r}
    assert set(logged) == {1, 2, 3, 4}  # a loss row per step carries that step's shift too
    assert {s: r["routing_shift"] for s, r in logged.items()} == {
        r["step"]: r["mean_shift"] for r in rows}  # fmt: skip
    assert {s: r["routing_shift_top1"] for s, r in logged.items()} == {
        r["step"]: r["mean_top1_shift"] for r in rows}  # fmt: skip
    summary = json.loads((run / "summary.json").read_text())
    assert summary["routing_shift"]["steps"] == 4
    # the base's routing was measured on the prompts, so collapse is judged against it
    assert [b["layer"] for b in summary["routing"]["base"]] == [0, 1]
    assert result.routing_shift == summary["routing_shift"]["mean_shift"]
    assert "reward" in _jsonl(run / "metrics.jsonl")[-1]


def test_grpo_routing_shift_reaches_the_trackers(grpo):
    result, _, cfg = grpo
    if not cfg.output.report_to:
        pytest.skip("tensorboard is not installed (pip install 'moetune[trackers]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = Path(result.run_dir)
    events = EventAccumulator(str(run / "trackers" / "tensorboard"))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("train/moe/routing_shift_mean")}
    rows = {r["step"]: r for r in _jsonl(run / "routing_shift.jsonl")}
    assert set(logged) == set(rows) == {1, 2, 3, 4}
    for step, row in rows.items():
        assert logged[step] == pytest.approx(row["mean_shift"], abs=1e-6)
        layer = {e.step: e.value for e in events.Scalars("train/moe/routing_shift/layer_1")}
        assert layer[step] == pytest.approx(row["layers"][1]["shift"], abs=1e-6)
    top1 = {e.step: e.value for e in events.Scalars("train/moe/routing_shift_top1_mean")}
    assert top1 == pytest.approx({s: r["mean_top1_shift"] for s, r in rows.items()}, abs=1e-6)


def test_grpo_on_mixtral_with_a_kl_reference(files):
    cfg = run_config(
        files.mixtral, files.prompts, files.root / "grpo-mixtral", method="grpo", max_steps=2,
        batch_size=4, grpo={**GRPO, "beta": 0.04},
    )  # fmt: skip
    result, trainer = train_capturing(cfg)
    assert (result.steps, result.coverage, result.router_changed) == (2, 1.0, False)
    assert reference_of(trainer) == "adapter disabled" and trainer.beta == 0.04
    assert list(trainer.model.peft_config) == ["default"]
    rows = _jsonl(Path(result.run_dir) / "routing_shift.jsonl")
    assert rows and all(x["tokens"] > 0 for x in rows[0]["layers"])


@pytest.mark.parametrize("engine", ["moetune", "peft", "moetune+offload"])
def test_grpo_with_routing_replay_trains_the_rollouts_experts(files, tmp_path, engine):
    """Split LoRA, peft, and frozen experts offloaded to host RAM (streamed per layer)."""
    name, _, offload = engine.partition("+")
    cfg = run_config(
        files.qwen, files.prompts, tmp_path / name, method="grpo", max_steps=2, batch_size=4,
        grpo={**GRPO, "routing_replay": "replay"}, lora__engine=name,
        **({"offload": "cpu"} if offload else {}),
    )  # fmt: skip
    result = train(cfg, progress=False)
    shift = json.loads((Path(result.run_dir) / "summary.json").read_text())["routing_shift"]
    assert shift["routing_replay"] == "replay" and result.router_changed is False
    assert (Path(result.run_dir) / "offload.json").is_file() == bool(offload)
    compared = sum(x["tokens"] for r in _jsonl(Path(result.run_dir) / "routing_shift.jsonl")
                   for x in r["layers"])  # fmt: skip
    assert shift["replayed_tokens"] >= compared > 0  # every compared token was replayed
    live = shift["adapter_live"]  # TRL's generation and fused-head training pass agree
    assert live["tokens"] > 0 and live["rollout_vs_policy"] < 1e-4


def test_shift_recorder_sees_a_router_that_moved_between_rollout_and_training(files):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from moetune.model import load_spec

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(files.qwen), LoraConfig(r=2, target_modules=["q_proj"])
    )
    recorder = ShiftRecorder(model, load_spec(str(files.qwen)))
    prompt = torch.tensor([[15, 4, 22, 23, 40], [15, 4, 5, 6, 40]])

    def step(perturb: bool) -> list[Any]:
        with torch.no_grad():
            seqs = model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)
        if perturb:  # the policy moved between rollout and update
            with torch.no_grad():
                for layer in model.get_base_model().model.layers:
                    layer.mlp.gate.weight.mul_(-1)
        model.train()
        model(input_ids=seqs, attention_mask=torch.ones_like(seqs))
        model.eval()
        return recorder.take()

    same = step(perturb=False)
    assert [x.tokens for x in same] == [2 * 8, 2 * 8] and all(x.share == 0 for x in same)
    moved = step(perturb=True)
    assert all(x.share > 0.5 for x in moved)  # negated router: top-2 of 4 flips
    assert all(x.top1_share == 1.0 for x in moved)  # the first choice becomes the last


def test_grpo_with_an_all_nan_reward_fails_naming_it(files, tmp_path):
    """TRL alone would train on: reward null, loss 0, an adapter that learnt nothing."""
    rewards = [{"name": "test_train_rewards:nan_reward"}]
    cfg = run_config(files.qwen, files.prompts, tmp_path / "nan", method="grpo", max_steps=1,
                     batch_size=4, grpo={**GRPO, "rewards": rewards})  # fmt: skip
    with pytest.raises(TrainError) as err:
        train(cfg, progress=False)
    assert "reward test_train_rewards:nan_reward returned no finite value" in err.value.cause
    assert not (tmp_path / "nan" / "adapter").exists()
    row = _jsonl(Path(cfg.output.ledger))[-1]
    assert (row["kind"], row["status"]) == ("train", "failed") and "nan_reward" in row["reason"]


def test_refusals_before_anything_is_written(files, tmp_path):
    cases = [
        (dict(method="grpo", batch_size=6, grpo=GRPO), files.prompts, TrainError,
         "not a multiple of train.grpo.num_generations"),
        (dict(method="grpo", batch_size=4, grpo={**GRPO, "rewards": [{"name": "nope"}]}),
         files.prompts, TrainError, "unknown reward 'nope'"),
        (dict(method="grpo", batch_size=4, grpo=GRPO),
         write_jsonl(tmp_path / "noanswer.jsonl", [{"prompt": "a"}]), DataError,
         "edit_similarity) reads column 'answer'"),
        (dict(method="dpo"), files.prompts, DataError, "prompt rows"),
        (dict(method="grpo", batch_size=4, grpo={**GRPO, "use_vllm": True}), files.prompts,
         TrainError, "vLLM weight sync merges only peft's linear LoRA"),
    ]  # fmt: skip
    for n, (over, data, error, says) in enumerate(cases):
        out = tmp_path / f"run{n}"
        with pytest.raises(error) as err:
            train(run_config(files.qwen, data, out, **over), progress=False)
        assert says in err.value.cause, err.value.cause
        assert not out.exists()
