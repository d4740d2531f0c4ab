"""`moetune data RUN.yaml`: the preview a person reads before training – rows per source and
after mixing, lengths against seq_len, the loss share, masked samples, duplicates, steps."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moetune.cli import app
from test_train_helpers import GEN_TEMPLATE, save_tiny_model, write_jsonl


def _chat(q: str, a: str) -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def _config(tmp_path, **data) -> str:
    model = save_tiny_model(tmp_path / "m", chat_template=GEN_TEMPLATE)
    rows = [_chat("rev:ab", "ba"), _chat("rev:abc", "cba"), _chat("rev:" + "a" * 30, "a" * 30)]
    train = write_jsonl(tmp_path / "a.jsonl", rows)
    other = write_jsonl(tmp_path / "b.jsonl", [_chat("rev:xy", "yx")])
    held = write_jsonl(tmp_path / "e.jsonl", [_chat("rev:ab", "ba"), _chat("rev:zz", "zz")])
    cfg = {
        "model": {"id": str(model)},
        "data": {"sources": [{"path": str(train), "weight": 2}, {"path": str(other)}],
                 "eval_file": str(held), **data},
        "train": {"seq_len": 32, "batch_size": 2, "grad_accum": 1, "epochs": 1, "device": "cpu"},
        "output": {"dir": str(tmp_path / "out"), "ledger": str(tmp_path / "ledger.jsonl")},
    }  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_data_json_counts_lengths_loss_duplicates_and_steps(tmp_path):
    result = CliRunner().invoke(app, ["data", _config(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    assert [(s["rows"], s["weight"]) for s in got["sources"]] == [(3, 2.0), (1, 1.0)]
    assert (got["rows"], got["eval_rows"], got["format"]) == (7, 2, "messages")
    assert sum(h["rows"] for h in got["histogram"]) == 7
    assert got["histogram"][-1] == {"upto": None, "rows": 2}  # the long row, twice
    assert got["truncated"] == 2 and got["no_loss_left"] == 2  # its reply starts past 32
    assert got["duplicates"] == 1  # "rev:ab" is in both
    assert got["steps"] == 4  # ceil(7 / 2)
    # "rev:ab>" context and "ba<eos>" loss: 3 of 10 tokens
    assert got["samples"] and all(isinstance(loss, bool) for _, loss in got["samples"][0])
    short = [s for s in got["samples"] if "".join(t for t, _ in s) == "rev:ab>ba<eos>"]
    assert short and short[0] == [["rev:ab>", False], ["ba<eos>", True]]
    assert 0 < got["loss_share"] < 1
    # the run's data.json keeps this preview; the HTML report shows it with the loss in [ ]
    from moetune.report.html import preview_rows

    rows = preview_rows(got)
    assert rows[0] == (
        "data sources",
        f"{tmp_path / 'a.jsonl'}: 3 × 2.0, {tmp_path / 'b.jsonl'}: 1 × 1.0",
    )
    assert "rev:ab>[ba<eos>]" in [text for label, text in rows if label.startswith("sample")]


def test_data_tables_and_the_step_time_on_a_card(tmp_path):
    card = ["--set", "hardware.card=H100-80GB"]
    result = CliRunner().invoke(app, ["data", _config(tmp_path), *card])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "after mixing" in out and "7" in out and "> 32" in out
    assert "2 rows over seq_len" in out and "1 also in train" in out
    assert "s/step on H100-80GB" in out and "sample 1" in out


def test_data_bad_row_is_one_line_and_exit_2(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [_chat("rev:ab", "")])
    cfg = _config(tmp_path)
    result = CliRunner().invoke(app, ["data", cfg, "--set", f"data.eval_file={bad}"])
    assert result.exit_code == 2
    assert "bad.jsonl line 1" in result.output and "empty assistant turn" in result.output
    assert "Traceback" not in result.output


# ---------------------------------------------------------------- preview and train agree


def _streamed_images(tmp_path) -> list[str]:
    from test_train_images import image_rows

    rows = image_rows(tmp_path / "vis")
    return ["--set", f"data.sources=[{{path: {rows}}}]", "--set", "data.eval_file=null",
            "--set", "data.streaming=true", "--set", "train.max_steps=2"]  # fmt: skip


def _no_template(tmp_path) -> list[str]:
    plain = save_tiny_model(tmp_path / "plain")  # a tokenizer with no chat template
    return ["--set", f"model.id={plain}"]


def _empty_template(tmp_path) -> list[str]:
    (tmp_path / "empty.jinja").write_text("\n", encoding="utf-8")
    return ["--set", f"data.chat_template={tmp_path / 'empty.jinja'}"]


def _broken_template(tmp_path) -> list[str]:
    (tmp_path / "broken.jinja").write_text("{{ raise_exception('no system turn') }}")
    return ["--set", f"data.chat_template={tmp_path / 'broken.jinja'}"]


REFUSED = {  # what train refuses, and the words its one line must hold
    "streaming without max_steps": (lambda p: ["--set", "data.streaming=true"], "train.max_steps"),
    "overlong error": (lambda p: ["--set", "data.overlong=error"], "a.jsonl line 3"),
    "streamed image rows": (_streamed_images, "image+text rows are not streamed"),
    "an empty template": (_empty_template, "the template is empty"),
    "no chat template": (_no_template, "data.chat_template"),
    # refused up front, before any row (data.template.check_template): no system turn
    "a template that cannot render": (_broken_template, "cannot render a user → assistant"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_data_refuses_what_train_refuses_in_the_same_line(tmp_path, case):
    """`moetune data` runs train's own checks (train.setup.check_data, data.load.usable):
    it never passes (exit 0) or crashes (exit 3) where train refuses in one line (exit 2)."""
    make, words = REFUSED[case]
    cfg, extra = _config(tmp_path), make(tmp_path)
    lines = {}
    for command in ("data", "train"):
        result = CliRunner().invoke(app, [command, cfg, *extra])
        assert result.exit_code == 2, (command, result.output)
        assert "Traceback" not in result.output
        lines[command] = " ".join(result.output.split())  # rich wraps long lines
    assert lines["data"] == lines["train"] and words in lines["data"]
    if case == "no chat template":  # names the fix and the templates TRL ships
        assert "qwen3" in lines["data"] and "in all" in lines["data"]
