"""First time right with your own model and data: a tokenizer that cannot carry the run, data
with no token carrying loss, a run.yaml without `model:`, a train.seq_len past the model's
positions – each refused in one line by `lint`, `data` and `train` before any weight loads;
and a run whose loss is exactly 0 stopped with the cause."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from moetune.cli import app
from moetune.errors import MoetuneError
from moetune.lint.rules.model import positions
from moetune.train.callbacks import ZERO_LOSS_STEPS, MetricsCallback
from test_train_helpers import (
    GEN_TEMPLATE,
    one_thread,
    reverse_rows,
    run_config,
    save_tiny_model,
    write_jsonl,
)

runner = CliRunner()


def _bare_model(out: Path, vocab_size: int) -> Path:
    """A tiny qwen3_moe saved the way a user saves their own: save_pretrained, and no
    tokenizer beside it."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(out)
    return out


def _tokenizer_dir(out: Path, chat_template: str | None = None) -> tuple[Path, int]:
    """The demo's character tokenizer, saved with transformers' save_pretrained."""
    from moetune.demo.tokenizer import build_tokenizer

    tok = build_tokenizer()
    if chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(out)
    return out, len(tok)


def _run_yaml(tmp_path: Path, base: Path, rows: list, **sections: dict) -> str:
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = {
        "model": {"id": str(base)},
        "data": {"train_file": str(data)},
        "train": {"seq_len": 32, "batch_size": 2, "max_steps": 2, "device": "cpu"},
        "output": {"dir": str(tmp_path / "out"), "ledger": str(tmp_path / "ledger.jsonl")},
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(cfg))
    return str(path)


def _refused_alike(config: str, cause: str, *extra: str) -> None:
    """lint (exit 1, the finding), data and train (exit 2, one line) say `cause`; train
    writes nothing: it stopped before any weight loaded."""
    linted = runner.invoke(app, ["lint", config, "--json", *extra])
    assert linted.exit_code == 1, linted.output
    errors = [f for f in json.loads(linted.stdout)["findings"] if f["severity"] == "error"]
    assert cause in " ".join(f["message"] for f in errors), errors
    lines = {}
    for command in ("data", "train"):
        out = runner.invoke(app, [command, config, *extra])
        assert out.exit_code == 2, out.output
        lines[command] = " ".join(out.output.split())  # rich wraps long lines
        assert cause in lines[command] and "Traceback" not in out.output
    assert lines["data"] == lines["train"]  # one line, whoever says it
    assert not (Path(config).parent / "out").exists()


def test_a_model_dir_without_tokenizer_files_is_refused_and_model_tokenizer_serves(tmp_path):
    tok_dir, vocab = _tokenizer_dir(tmp_path / "tok")
    model = _bare_model(tmp_path / "m", vocab)
    config = _run_yaml(tmp_path, model, reverse_rows(6))
    _refused_alike(config, f"{model} holds no tokenizer file")
    # the tokenizer from elsewhere: the preview renders the rows, not bare end tokens
    out = runner.invoke(app, ["data", config, "--json", "--set", f"model.tokenizer={tok_dir}"])
    assert out.exit_code == 0, out.output
    got = json.loads(out.stdout)
    assert "".join(t for t, _ in got["samples"][0]).startswith("rev:")
    assert 0 < got["loss_share"] < 1


def test_a_tokenizer_wider_than_the_embedding_is_refused_a_narrower_one_passes(tmp_path):
    tok_dir, vocab = _tokenizer_dir(tmp_path / "tok")
    rows = reverse_rows(6)
    narrow = _run_yaml(tmp_path, _bare_model(tmp_path / "narrow", vocab - 4), rows,
                       model={"tokenizer": str(tok_dir)})  # fmt: skip
    _refused_alike(narrow, f"has {vocab} tokens but the model has {vocab - 4} embedding rows")
    # padded embedding rows (Qwen3: 151,669 tokens in 151,936 rows) are the normal case
    wide = _run_yaml(tmp_path, _bare_model(tmp_path / "wide", vocab + 16), rows,
                     model={"tokenizer": str(tok_dir)})  # fmt: skip
    assert runner.invoke(app, ["data", wide, "--json"]).exit_code == 0


def _chat(q: str, a: str) -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def test_messages_without_a_chat_template_are_refused_by_lint_too(tmp_path):
    tok_dir, vocab = _tokenizer_dir(tmp_path / "tok")  # no template
    model = _bare_model(tmp_path / "m", vocab)
    rows = [_chat("rev:ab", "ba"), _chat("rev:abc", "cba")]
    config = _run_yaml(tmp_path, model, rows, model={"tokenizer": str(tok_dir)})
    _refused_alike(config, "rows with message lists need a chat template")
    fixed = ["--set", f"data.chat_template={tmp_path / 'chat.jinja'}"]
    (tmp_path / "chat.jinja").write_text(GEN_TEMPLATE)
    assert runner.invoke(app, ["data", config, *fixed]).exit_code == 0


def test_data_with_no_token_carrying_loss_is_refused_before_training(tmp_path):
    # generation markers that wrap nothing: every assistant token is masked out
    empty = (
        "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}"
        "{% generation %}{% endgeneration %}<eos>{% endif %}{% endfor %}"
    )
    model = save_tiny_model(tmp_path / "m", chat_template=empty)
    config = _run_yaml(tmp_path, model, [_chat("rev:ab", "ba"), _chat("rev:abc", "cba")])
    for command in ("data", "train"):
        out = runner.invoke(app, [command, config])
        assert out.exit_code == 2, out.output
        assert "no token of 2 training rows carries loss" in out.output
    assert not (tmp_path / "out").exists()


def test_zero_loss_rows_stop_a_run_only_from_the_start():
    def feed(losses: list[float]) -> int:
        metrics = MetricsCallback(lambda row: None, zero_stop=ZERO_LOSS_STEPS)
        args, state = type("A", (), {"should_save": False})(), type("S", (), {})()
        state.num_input_tokens_seen = 0
        for step, loss in enumerate(losses, 1):
            state.global_step = step
            metrics.on_log(args, state, None, logs={"loss": loss})
        return step

    with pytest.raises(MoetuneError, match="exactly 0 at each of the first 3 logged steps"):
        feed([0.0, 0.0, 0.0, 0.0])
    assert feed([0.0, 0.7, 0.0, 0.0, 0.0]) == 5  # it learned once: a later 0 is a fit
    assert MetricsCallback(lambda row: None).zero_stop == 0  # GRPO: off


def test_a_run_whose_loss_is_exactly_zero_is_stopped_with_the_cause(tmp_path, monkeypatch):
    import trl

    from moetune.train import train

    real = trl.SFTTrainer.compute_loss

    def nothing_learned(self, *args, **kwargs):  # as when every label is -100
        got = real(self, *args, **kwargs)
        return (got[0] * 0, *got[1:]) if isinstance(got, tuple) else got * 0

    monkeypatch.setattr(trl.SFTTrainer, "compute_loss", nothing_learned)
    model = save_tiny_model(tmp_path / "m")
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(16))
    cfg = run_config(model, data, tmp_path / "out", max_steps=8, save_steps=8)
    with one_thread(), pytest.raises(MoetuneError, match="learns nothing") as err:
        train(cfg, progress=False)
    assert "step 3" in err.value.cause
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows if "loss" in r] == [0.0] * ZERO_LOSS_STEPS


def test_a_run_yaml_without_model_names_the_field(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"train": {"seq_len": 64}}))
    for command in ("lint", "plan", "data", "train"):
        out = runner.invoke(app, [command, str(config)])
        assert out.exit_code == 2, (command, out.output)
        assert "has no model.id" in out.output and "Qwen/Qwen3-30B-A3B" in out.output
    named = runner.invoke(app, ["plan", str(config), "--set", "model.id=Qwen/Qwen3-30B-A3B"])
    assert named.exit_code == 0, named.output


def test_seq_len_past_the_models_positions_is_a_lint_error_and_stops_train(tmp_path):
    model = save_tiny_model(tmp_path / "m")  # max_position_embeddings 64
    config = _run_yaml(tmp_path, model, reverse_rows(6), train={"seq_len": 96})
    linted = runner.invoke(app, ["lint", config, "--json"])
    assert linted.exit_code == 1
    found = {f["rule_id"]: f for f in json.loads(linted.stdout)["findings"]}
    message = found["SEQ-PAST-POSITIONS"]["message"]
    assert "train.seq_len 96 is longer than the 64 positions" in message
    out = runner.invoke(app, ["train", config])
    assert out.exit_code == 2 and "[SEQ-PAST-POSITIONS]" in out.output
    assert not (tmp_path / "out").exists()
    assert runner.invoke(app, ["lint", config, "--set", "train.seq_len=64"]).exit_code == 0


def test_positions_count_a_rope_scaling_factor():
    assert positions({"max_position_embeddings": 4096}) == 4096
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert positions({"max_position_embeddings": 40960, "rope_scaling": yarn}) == 131072
    default = {"rope_type": "default", "rope_theta": 1e6}
    assert positions({"max_position_embeddings": 40960, "rope_parameters": default}) == 40960
    assert positions({"text_config": {"max_position_embeddings": 8192}}) == 8192
    assert positions({}) is None


def test_a_remote_run_takes_a_local_model_tokenizer_along(tmp_path):
    from moetune.config import parse_config
    from moetune.lane.stage import staging

    tok_dir, _ = _tokenizer_dir(tmp_path / "tok")
    out = staging(parse_config({"model": {"id": "Qwen/Qwen3-30B-A3B", "tokenizer": str(tok_dir)}}))
    assert out.config.model.tokenizer == "tokenizer" and (tok_dir, "tokenizer") in out.files
    hub = staging(parse_config({"model": {"tokenizer": "Qwen/Qwen3-30B-A3B"}}))
    assert hub.config.model.tokenizer == "Qwen/Qwen3-30B-A3B"  # fetched on the pod
