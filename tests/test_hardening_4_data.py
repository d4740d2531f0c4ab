"""Issue 48 (fourth hardening pass), data: inputs that used to end in exit 3, a wrong cause or
silence are refused in one line that names the source and the fix, before any model is built."""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import pytest
import yaml
from PIL import Image
from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import DataArgs
from moetune.data import check_sources
from moetune.data.errors import DataError
from moetune.data.images import with_images
from moetune.demo.base import SHIPPED_DIR
from test_train_helpers import write_jsonl

SFT = ("messages", "prompt/completion", "text")


def _refused(**data: object) -> DataError:
    with pytest.raises(DataError) as info:
        check_sources(DataArgs(**data), SFT)
    assert "\n" not in str(info.value) and info.value.fix
    return info.value


def test_a_relative_source_dir_holding_a_txt_is_named_not_exit_3(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("mixed").mkdir()
    write_jsonl(Path("mixed/a.jsonl"), [{"text": "rev:ab>ba"}])
    Path("mixed/notes.txt").write_text("a note\n", encoding="utf-8")
    err = _refused(sources=[{"path": "mixed"}])  # was: ValueError from Path.relative_to
    assert "notes.txt would not be read" in err.cause


def test_a_dir_of_only_txt_files_is_refused_as_a_txt_beside_rows_is(tmp_path):
    (tmp_path / "a.txt").write_text("rev:ab>ba\nrev:cd>dc\n", encoding="utf-8")
    err = _refused(sources=[{"path": str(tmp_path)}])  # was: trained as two "text" rows
    assert "a.txt would not be read" in err.cause and "convert them" in err.fix


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_fifo_or_device_named_jsonl_is_named_as_such_not_not_found(tmp_path, kind):
    path = tmp_path / "rows.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/null")
    for data in ({"sources": [{"path": str(path)}]}, {"train_file": str(path)}):
        err = _refused(**data)
        assert "not a regular file" in err.cause and "not found" not in err.cause


def test_a_row_with_a_duplicate_json_key_is_refused_naming_the_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "a"}\n{"text": "kept?", "text": "or this?"}\n', encoding="utf-8")
    err = _refused(train_file=str(path))  # was: trained on the last value without a word
    assert f"{path} line 2: key 'text' appears twice" in err.cause
    array = tmp_path / "rows.json"
    array.write_text('[{"prompt": "a", "completion": "b", "prompt": "c"}]', encoding="utf-8")
    assert "key 'prompt' appears twice" in _refused(train_file=str(array)).cause


def test_a_split_on_a_dataset_saved_alone_is_refused_not_ignored(tmp_path):
    from datasets import Dataset

    Dataset.from_list([{"text": "rev:ab>ba"}] * 2).save_to_disk(str(tmp_path / "saved"))
    err = _refused(sources=[{"path": str(tmp_path / "saved"), "split": "test"}])
    assert "has no splits" in err.cause and "'test'" in err.cause
    check_sources(DataArgs(sources=[{"path": str(tmp_path / "saved")}]), SFT)  # train: fine


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_header(width: int, height: int) -> bytes:
    """A PNG that claims `width` x `height` (Pillow checks the size before any pixel)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\0" * (width + 1))  # one row: the file stays tiny
    chunks = _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + chunks


def _image_row(name: str) -> dict:
    turns = [{"role": "user", "content": "what?"}, {"role": "assistant", "content": "a cat"}]
    return {"messages": turns, "images": [name]}


def test_a_400_megapixel_png_and_a_dir_as_image_are_named(tmp_path):
    (tmp_path / "huge.png").write_bytes(_png_header(20_000, 20_000))
    with pytest.raises(DataError) as info:  # was: DecompressionBombError, exit 3
        with_images("src", "line 1", _image_row("huge.png"), tmp_path)
    assert "over Pillow's limit" in info.value.cause and "huge.png" in info.value.cause
    (tmp_path / "pics").mkdir()
    with pytest.raises(DataError) as info:  # was: "not found"
        with_images("src", "line 1", _image_row("pics"), tmp_path)
    assert "is a directory" in info.value.cause
    Image.new("RGB", (4, 4)).save(tmp_path / "ok.png")
    assert with_images("src", "line 1", _image_row("ok.png"), tmp_path)["images"]


def test_max_rows_holds_in_the_preview_of_a_streamed_run(tmp_path):
    """`moetune data` of a streamed run read the first 100 rows of each source, past a
    smaller max_rows: it showed rows training never reads."""
    import json as _json

    from typer.testing import CliRunner

    from moetune.cli import app
    from test_data_cli import _config

    cfg = _config(tmp_path)
    sets = ["--set", "data.streaming=true", "--set", "train.max_steps=2"]
    sources = f"[{{path: {tmp_path / 'a.jsonl'}, max_rows: 2}}]"
    result = CliRunner().invoke(
        app, ["data", cfg, *sets, "--set", f"data.sources={sources}", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert [s["rows"] for s in _json.loads(result.stdout)["sources"]] == [2]  # was: 3


NO_REPLY = {  # templates that render no assistant token: one drops the reply, one marks nothing
    "dropped": "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}>"
    "{% endif %}{% endfor %}",
    "empty-marks": "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
    "{% endgeneration %}{% else %}{{ m['content'] }}>{% endif %}{% endfor %}",
}


@pytest.mark.parametrize(("template", "rows"), [("dropped", "messages"), ("empty-marks", "pc")])
def test_a_template_that_leaves_no_completion_token_is_refused_before_training(
    tmp_path, template, rows
):
    """TRL's trainer died on `num_samples=0` when the template left no completion token."""
    user, reply = {"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}
    row = (
        {"messages": [user, reply]}
        if rows == "messages"
        else {"prompt": [user], "completion": [reply]}
    )
    (tmp_path / "t.jinja").write_text(NO_REPLY[template])
    cfg = {
        "model": {"id": str(SHIPPED_DIR)},
        "data": {"train_file": str(write_jsonl(tmp_path / "d.jsonl", [row] * 4)),
                 "chat_template": str(tmp_path / "t.jinja")},
        "output": {"dir": str(tmp_path / "run"), "ledger": str(tmp_path / "ledger.jsonl")},
        "train": {"max_steps": 1, "seq_len": 64, "device": "cpu"},
    }  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    out = CliRunner().invoke(app, ["train", str(tmp_path / "run.yaml")])
    assert out.exit_code == 2 and "Traceback" not in out.output, out.output
    assert "no token of 4 training rows carries loss" in out.stderr
    assert "{% generation %}" in out.stderr and not (tmp_path / "run").exists()
