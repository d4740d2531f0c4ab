"""The eval scores what was trained: a run trained on `messages` rows records its rendering
(data.json), and `moetune eval` renders every rung's prompts through the same chat template –
the reported scores are the templated ones, computed here directly with transformers."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from typer.testing import CliRunner

from moetune.cli import app
from moetune.train import train
from test_train_helpers import GEN_TEMPLATE, one_thread, run_config, save_tiny_model, write_jsonl

WORDS = ("abc", "moe", "lora", "gate", "tune", "xyz")
pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny chat model (its own template, saved with save_pretrained) trained 2 steps on
    messages rows, and a run.yaml with an exact_match and a loss rung on raw prompts."""
    root = tmp_path_factory.mktemp("templated")
    model = save_tiny_model(root / "model", chat_template=GEN_TEMPLATE)
    chats = [
        {"messages": [{"role": "user", "content": f"rev:{w}"},
                      {"role": "assistant", "content": w[::-1]}]}
        for w in WORDS * 2
    ]  # fmt: skip
    data = write_jsonl(root / "chat.jsonl", chats)
    cfg = run_config(model, data, root / "run", max_steps=2, save_steps=50, routing_every=1)
    with one_thread():
        train(cfg, progress=False)
    em = write_jsonl(root / "em.jsonl", [{"prompt": f"rev:{w}", "answer": w[::-1]} for w in WORDS])
    loss = write_jsonl(
        root / "loss.jsonl", [{"prompt": f"rev:{w}", "completion": w[::-1]} for w in WORDS]
    )
    doc = yaml.safe_load((root / "run" / "config.yaml").read_text())
    doc["model"]["dtype"] = "float32"
    doc["eval"] = {"rungs": [
        {"name": "em", "kind": "exact_match", "data": str(em)},
        {"name": "loss", "kind": "loss", "data": str(loss)},
    ]}  # fmt: skip
    (root / "run.yaml").write_text(yaml.safe_dump(doc))
    return {"root": root, "model": model, "config": root / "run.yaml", "run": root / "run"}


def _direct(model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return model, tok


def _templated(tok: Any, prompt: str) -> list[int]:
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return list(tok(text, add_special_tokens=False)["input_ids"])


@torch.no_grad()
def _greedy(model: Any, tok: Any, ids: list[int], steps: int) -> str:
    out = list(ids)
    for _ in range(steps):
        nxt = int(model(input_ids=torch.tensor([out])).logits[0, -1].argmax())
        out.append(nxt)
        if nxt == tok.eos_token_id:
            break
    new = out[len(ids) :]
    new = new[: new.index(tok.eos_token_id)] if tok.eos_token_id in new else new
    return str(tok.decode(new)).split("<eos>", 1)[0]


@torch.no_grad()
def _neg_nll(model: Any, ctx: list[int], cont: list[int]) -> float:
    ids = torch.tensor([ctx + cont], dtype=torch.long)
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), dim=-1)
    return sum(float(logp[len(ctx) - 1 + j, t]) for j, t in enumerate(cont)) / len(cont)


def _items(results: Path, rung: str) -> list[dict[str, Any]]:
    lines = (results / "rungs" / f"{rung}.items.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_train_records_how_rows_were_rendered(run: dict[str, Path]) -> None:
    rendering = json.loads((run["run"] / "data.json").read_text())["rendering"]
    assert rendering == {
        "format": "messages",
        "chat": True,
        "template": f"the tokenizer of {run['model']}",
        "template_sha256": hashlib.sha256(GEN_TEMPLATE.encode()).hexdigest(),
    }


def test_eval_reports_the_templated_scores(run: dict[str, Path]) -> None:
    got = CliRunner().invoke(app, ["eval", str(run["config"]), "--json"])
    assert got.exit_code in (0, 1), got.output  # a verdict, whichever it is
    results = run["run"] / "eval"
    ladder = json.loads((results / "ladder.json").read_text())
    assert ladder["rendering"]["chat"] is True
    model, tok = _direct(run["model"])  # the base, scored here by hand
    # loss: the reported base score is the templated mean -NLL, not the raw one
    ctxs = [_templated(tok, f"rev:{w}") for w in WORDS]
    conts = [list(tok(w[::-1], add_special_tokens=False)["input_ids"]) for w in WORDS]
    templated = [_neg_nll(model, c, t) for c, t in zip(ctxs, conts, strict=True)]
    raw_ctx = [list(tok(f"rev:{w}")["input_ids"]) for w in WORDS]
    raw = [_neg_nll(model, c, t) for c, t in zip(raw_ctx, conts, strict=True)]
    reported = {r["name"]: r for r in ladder["rungs"]}
    assert reported["loss"]["base"]["score"] == pytest.approx(sum(templated) / len(WORDS), rel=1e-5)
    per_item = [row["base"] for row in _items(results, "loss")]
    assert per_item == pytest.approx(templated, rel=1e-5)
    # the rendering matters: scored raw, items would differ by far more than the tolerance
    assert max(abs(r - t) for r, t in zip(raw, templated, strict=True)) > 1e-2
    # exact_match: every base output is the greedy continuation of the templated prompt
    rows = _items(results, "em")
    steps = [len(tok(w[::-1], add_special_tokens=False)["input_ids"]) + 1 for w in WORDS]
    direct = [_greedy(model, tok, c, n) for c, n in zip(ctxs, steps, strict=True)]
    assert [r["base_output"] for r in rows] == direct
    assert [r["prompt"] for r in rows] == [f"rev:{w}" for w in WORDS]  # as the user wrote it
    raw_out = [_greedy(model, tok, c, n) for c, n in zip(raw_ctx, steps, strict=True)]
    assert raw_out != direct  # a raw prompt would have been scored on other outputs


def test_another_template_than_trained_is_refused(run: dict[str, Path], tmp_path: Path) -> None:
    other = tmp_path / "other.jinja"
    other.write_text("{% for m in messages %}{{ m['content'] }}|{% endfor %}")
    args = ["eval", str(run["config"]), "--overwrite", "--set", f"data.chat_template={other}"]
    got = CliRunner().invoke(app, args)
    assert got.exit_code == 2, got.output
    assert "differs from the one the run trained with" in got.output
    assert "Traceback" not in got.output
