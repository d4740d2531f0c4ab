"""train.grpo.sft_weight: the NLL term on prompt rows' `completion` beside GRPO's loss – the
labels it trains on, the loss and gradient it adds (against a float64 per-row reference),
rows without a completion untouched, and the run end to end with its refusal."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch

from moetune.train import train
from moetune.train.errors import DataError
from moetune.train.grpo.sft import SftTerm, completion_problem, sft_batch, with_sft_term
from test_train_helpers import (
    GEN_TEMPLATE,
    run_config,
    save_tiny_model,
    train_capturing,
    write_jsonl,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = save_tiny_model(tmp_path_factory.mktemp("grpo-sft") / "qwen")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return path, model.train(), AutoTokenizer.from_pretrained(path)


def _ids(tok: Any, text: str) -> list[int]:
    return list(tok(text=text, add_special_tokens=False)["input_ids"])


def test_a_completion_must_match_its_prompt_kind():
    chat = [{"role": "user", "content": "hi"}]
    assert (
        completion_problem(["a>", chat, "b>"], ["x", [{"role": "assistant", "content": "y"}], ""])
        is None
    )
    assert completion_problem(["a>", chat], ["x", "y"]) == (
        "row 2: 'completion' must be a list of messages like its prompt, or empty"
    )


def test_labels_are_the_completion_and_eos_once_per_prompt(tiny):
    _, _, tok = tiny
    rows = [
        {"prompt": "rev:ab>", "completion": "ba<eos>"},
        {"prompt": "rev:ab>", "completion": "ba<eos>"},  # TRL's repeat for the group
        {"prompt": "last:ab>", "completion": ""},  # RL only
        {"prompt": "rev:xyz>", "completion": "zyx"},  # EOS appended
    ]
    batch = sft_batch(tok, rows, "cpu")
    labels = [[t for t in row.tolist() if t != -100] for row in batch["sft_labels"]]
    eos = tok.eos_token_id
    assert labels == [[*_ids(tok, "ba"), eos], [], [], [*_ids(tok, "zyx"), eos]]
    head = list(tok(text="rev:xyz>")["input_ids"])  # the prompt as the rollout tokenises it
    assert batch["sft_ids"][3].tolist() == head + labels[3]
    first = len(tok(text="rev:ab>")["input_ids"]) + len(labels[0])
    assert batch["sft_mask"].sum(1).tolist() == [first, 1, 1, len(head) + len(labels[3])]


def test_a_conversation_trains_on_the_assistant_turn_after_the_rendered_prompt():
    from moetune.demo.tokenizer import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = GEN_TEMPLATE  # user turns end in ">", assistant turns in "<eos>"
    user = [{"role": "user", "content": "rev:ab"}]
    rows = [{"prompt": user, "completion": [{"role": "assistant", "content": "ba"}]}]
    batch = sft_batch(tok, rows, "cpu")
    labels = [t for t in batch["sft_labels"][0].tolist() if t != -100]
    assert labels == [*_ids(tok, "ba"), tok.eos_token_id]  # the template's EOS, not doubled
    assert batch["sft_ids"][0].tolist() == [*_ids(tok, "rev:ab>"), *labels]


class _FakeGrpo:
    """Stands in for GRPOTrainer: a loss that depends on the model, accumulation 2."""

    current_gradient_accumulation_steps = 2

    def __init__(self, tok: Any) -> None:
        self.processing_class, self._metrics = tok, {"train": defaultdict(list)}
        self.accelerator = type("Acc", (), {"device": torch.device("cpu")})()

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        ids = [self.processing_class(text=r["prompt"])["input_ids"] for r in inputs]
        width = max(map(len, ids))
        return {"prompt_ids": torch.tensor([i + [0] * (width - len(i)) for i in ids])}

    def compute_loss(self, model: Any, inputs: dict[str, Any], *args: Any) -> torch.Tensor:
        assert set(inputs) == {"prompt_ids"}  # TRL's loss never sees the sft tensors
        return model(input_ids=inputs["prompt_ids"]).logits.float().pow(2).mean()


def _reference_nll(model: Any, tok: Any, pairs: list[tuple[str, str]]) -> torch.Tensor:
    """Token-mean NLL of the completions (+ EOS), row by row unpadded, log-softmax in f64."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for prompt, completion in pairs:
        head = list(tok(text=prompt)["input_ids"])
        full = [*head, *_ids(tok, completion), tok.eos_token_id]
        logits = model(input_ids=torch.tensor([full])).logits[0].double()
        logp = torch.log_softmax(logits[:-1], dim=-1)
        targets = torch.tensor(full[1:])
        total = total - logp[torch.arange(len(full) - 1), targets][len(head) - 1 :].sum()
        count += len(full) - len(head)
    return total / count


def _loss_and_grads(trainer: Any, model: Any, rows: list[dict[str, Any]]) -> tuple[Any, Any]:
    model.zero_grad()
    loss = trainer.compute_loss(model, trainer._generate_and_score_completions(rows))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_the_term_adds_weight_times_the_nll_to_loss_and_gradient(tiny):
    _, model, tok = tiny
    rows = [
        {"prompt": "rev:ab>", "completion": "ba"},
        {"prompt": "rev:ab>", "completion": "ba"},
        {"prompt": "last:abc>", "completion": ""},
        {"prompt": "copy:xyz>", "completion": "xyz"},
    ]
    plain = _FakeGrpo(tok)
    with_term = with_sft_term(_FakeGrpo, 0.5)(tok)
    base_loss, base_grads = _loss_and_grads(plain, model, rows)
    loss, grads = _loss_and_grads(with_term, model, rows)
    model.zero_grad()
    reference = _reference_nll(model, tok, [("rev:ab>", "ba"), ("copy:xyz>", "xyz")])
    (0.5 * reference / 2).backward()  # weight × NLL / accumulation steps
    ref_grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
    assert float(loss - base_loss) == pytest.approx(float(0.5 * reference.detach() / 2), rel=1e-5)
    diff = torch.cat([(g - b).double().flatten() for g, b in zip(grads, base_grads, strict=True)])
    want = torch.cat([g.flatten() for g in ref_grads])
    assert float((diff - want).norm() / want.norm()) < 1e-4
    logged = with_term._metrics["train"]["sft_nll"]
    assert logged == [pytest.approx(float(reference.detach()), rel=1e-5)]


def test_rows_without_a_completion_leave_grpo_untouched(tiny):
    _, model, tok = tiny
    rows = [{"prompt": "last:ab>", "completion": ""}, {"prompt": "last:xy>", "completion": None}]
    base_loss, base_grads = _loss_and_grads(_FakeGrpo(tok), model, rows)
    with_term = with_sft_term(_FakeGrpo, 1.0)(tok)
    loss, grads = _loss_and_grads(with_term, model, rows)
    assert torch.equal(loss, base_loss) and all(map(torch.equal, grads, base_grads))
    assert with_term._metrics["train"] == {}  # no extra forward
    assert with_sft_term(_FakeGrpo, 0.0) is _FakeGrpo  # weight 0: TRL's trainer itself


def test_grpo_run_with_the_term_and_its_refusal(tiny, tmp_path):
    path = tiny[0]
    rows = [
        {"prompt": f"rev:{w}>", "answer": w[::-1], "completion": w[::-1]}
        for w in ["abc", "moe", "tune", "lora"] * 2
    ]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    grpo = {"num_generations": 4, "max_completion_length": 6, "sft_weight": 1.0}
    cfg = run_config(path, data, tmp_path / "run", method="grpo", max_steps=2, batch_size=8,
                     grpo=grpo)  # fmt: skip
    result, trainer = train_capturing(cfg)
    assert (result.method, result.steps, result.coverage) == ("grpo", 2, 1.0)
    assert isinstance(trainer, SftTerm) and trainer.sft_weight == 1.0
    assert [r["sft_nll"] > 0 for r in trainer.state.log_history if "sft_nll" in r] == [True] * 2
    plain = [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]
    bare = write_jsonl(tmp_path / "bare.jsonl", plain)
    cfg = run_config(path, bare, tmp_path / "refused", method="grpo", batch_size=8, grpo=grpo)
    with pytest.raises(DataError, match="sft_weight trains on a 'completion' column"):
        train(cfg, progress=False)
    assert not (tmp_path / "refused").exists()
