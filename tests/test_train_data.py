"""Training data: TRL's three row conventions from JSONL/JSON/Parquet, every bad input a
one-line error naming the file and the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetune.config import DataArgs
from moetune.data import FORMATS, load_train_data
from moetune.demo.tokenizer import build_tokenizer
from moetune.train.errors import DataError
from test_train_helpers import GEN_TEMPLATE, reverse_rows, write_jsonl


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _load(path: Path, tok, seq_len: int = 32, completion_only: bool = True, **kw):
    args = DataArgs(train_file=str(path), completion_only_loss=completion_only, **kw)
    return load_train_data(args, tok, seq_len)[0]


def _error(path: Path, tok, **kw) -> DataError:
    with pytest.raises(DataError) as info:
        _load(path, tok, **kw)
    assert "\n" not in str(info.value)  # one line, cause and fix
    assert info.value.fix
    return info.value


# ---------------------------------------------------------------- formats


def test_prompt_completion_trains_on_the_completion(tmp_path, tok):
    data = _load(write_jsonl(tmp_path / "d.jsonl", reverse_rows(5)), tok)
    assert (data.format, data.rows) == ("prompt/completion", 5)
    assert data.dataset.column_names == ["prompt", "completion"]
    assert data.loss.sft == {"completion_only_loss": True}
    assert data.loss.on == "completion tokens"
    off = _load(tmp_path / "d.jsonl", tok, completion_only=False)
    assert off.loss.sft == {"completion_only_loss": False}


def test_text_rows_train_on_every_token_and_extra_keys_are_dropped(tmp_path, tok):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "copy:ab>ab", "id": i} for i in range(3)])
    data = _load(path, tok)
    assert data.format == "text"
    assert data.dataset.column_names == ["text"]
    assert data.loss.sft == {"completion_only_loss": False}
    assert "no completion" in data.loss.on


def _chat(content: str = "ba") -> dict:
    turns = [{"role": "user", "content": "rev:ab"}, {"role": "assistant", "content": content}]
    return {"messages": turns}


def test_messages_mask_assistant_turns_only_with_generation_tags(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [_chat(), _chat("cd")])
    tagged = build_tokenizer()
    tagged.chat_template = GEN_TEMPLATE
    assert _load(path, tagged).loss.sft == {"assistant_only_loss": True}
    plain = build_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    untagged = _load(path, plain)  # tokenised here, with masks from rendered prefixes
    assert untagged.loss.sft == {"assistant_only_loss": False} and untagged.loss.prerender
    assert untagged.dataset.column_names == ["input_ids", "assistant_masks"]
    assert untagged.dataset[0]["assistant_masks"] == [0] * 6 + [1] * 2  # "rev:ab" | "ba"


def test_messages_need_a_chat_template(tmp_path, tok):
    err = _error(write_jsonl(tmp_path / "m.jsonl", [_chat()]), tok)
    assert "chat template" in err.cause and "m.jsonl" in err.cause


def test_json_array_and_jsonl_named_json(tmp_path, tok):
    array = tmp_path / "a.json"
    array.write_text(json.dumps(reverse_rows(3), indent=2))
    assert _load(array, tok).rows == 3
    lines = write_jsonl(tmp_path / "l.json", reverse_rows(4))
    assert _load(lines, tok).rows == 4


def test_parquet(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(reverse_rows(4)), path)
    data = _load(path, tok)
    assert (data.format, data.rows) == ("prompt/completion", 4)


def test_registry_lists_the_trl_conventions_in_detection_order():
    # sft reads the first three; dpo preference rows; grpo prompt rows (matched last)
    assert list(FORMATS) == ["messages", "prompt/completion", "text", "preference", "prompt"]


# ---------------------------------------------------------------- bad input


def test_missing_file(tmp_path, tok):
    err = _error(tmp_path / "nope.jsonl", tok)
    assert "nope.jsonl" in err.cause and "not found" in err.cause


def test_empty_file(tmp_path, tok):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n  \n")
    err = _error(path, tok)
    assert "empty.jsonl" in err.cause and "empty" in err.cause


def test_malformed_row_names_file_and_line(tmp_path, tok):
    path = tmp_path / "bad.jsonl"
    rows = [json.dumps(r) for r in reverse_rows(3)]
    path.write_text("\n".join([rows[0], rows[1], '{"prompt": "x", "completion": ', rows[2]]))
    err = _error(path, tok)
    assert f"{path} line 3" in err.cause and "not valid JSON" in err.cause


def test_malformed_json_array_names_the_line(tmp_path, tok):
    path = tmp_path / "bad.json"
    path.write_text('[\n{"text": "ab"},\n{"text": }\n]')
    assert f"{path} line 3" in _error(path, tok).cause


def test_row_missing_a_key(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [*reverse_rows(2), {"prompt": "rev:ab>"}])
    err = _error(path, tok)
    assert f"{path} line 3" in err.cause and "'completion'" in err.cause


def test_mixed_formats(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [*reverse_rows(1), {"text": "copy:a>a"}])
    err = _error(path, tok)
    assert "line 2" in err.cause and "text row in a prompt/completion file" in err.cause


def test_unknown_format_lists_the_keys(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}])
    err = _error(path, tok)
    assert "line 1" in err.cause and "answer, question" in err.cause
    assert "prompt+completion" in err.fix


def test_row_that_is_not_an_object(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [["prompt", "completion"]])
    assert "must be a JSON object" in _error(path, tok).cause


def test_wrong_value_types(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": 3}])
    assert "both be strings" in _error(path, tok).cause
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    tagged = build_tokenizer()
    tagged.chat_template = GEN_TEMPLATE
    assert "no assistant turn" in _error(path, tagged).cause


def test_unknown_file_type(tmp_path, tok):
    path = tmp_path / "d.txt"
    path.write_text("prompt,completion\n")
    assert "'.txt'" in _error(path, tok).cause


def test_overlong_rows_are_counted_or_refused(tmp_path, tok):
    rows = [*reverse_rows(3), {"prompt": "rev:" + "a" * 40 + ">", "completion": "a" * 40}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    assert _load(path, tok, seq_len=32).overlong == 1
    err = _error(path, tok, seq_len=32, overlong="error")
    assert "line 4" in err.cause and "seq_len=32" in err.cause


def test_prompts_that_fill_seq_len_everywhere_are_refused_before_training(tmp_path, tok):
    """seq_len 1 left no completion token in any row: TRL dropped them all and the trainer
    died inside torch (exit 3). One row that keeps a completion token is enough to train."""
    rows = [{"prompt": "rev:" + "ab" * 4 + ">", "completion": "ba" * 4} for _ in range(3)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    err = _error(path, tok, seq_len=6)
    assert "every row's prompt fills train.seq_len=6" in err.cause
    assert "raise train.seq_len" in err.fix
    assert _load(path, tok, seq_len=6, completion_only=False).overlong == 3  # all tokens train
    mixed = write_jsonl(tmp_path / "m.jsonl", [*rows, {"prompt": "r>", "completion": "ab"}])
    assert _load(mixed, tok, seq_len=6).overlong == 3


def test_a_utf8_bom_and_crlf_line_ends_read_as_the_same_rows(tmp_path, tok):
    """A file saved by a Windows editor was refused at line 1 (`Unexpected UTF-8 BOM`)."""
    plain = write_jsonl(tmp_path / "d.jsonl", reverse_rows(3))
    text = plain.read_text(encoding="utf-8")
    windows = tmp_path / "w.jsonl"
    windows.write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    got, want = _load(windows, tok), _load(plain, tok)
    assert list(got.dataset["prompt"]) == list(want.dataset["prompt"]) and got.rows == 3


def test_train_and_eval_files_must_share_a_format(tmp_path, tok):
    train = write_jsonl(tmp_path / "t.jsonl", reverse_rows(3))
    held = write_jsonl(tmp_path / "e.jsonl", [{"text": "copy:a>a"}])
    with pytest.raises(DataError, match="same row format"):
        load_train_data(DataArgs(train_file=str(train), eval_file=str(held)), tok, 32)
    with pytest.raises(DataError, match="train_file is not set"):
        load_train_data(DataArgs(), tok, 32)


def test_sha256_changes_with_the_content(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", reverse_rows(3))
    first = _load(path, tok).sha256
    write_jsonl(path, reverse_rows(4))
    assert _load(path, tok).sha256 != first


# ---------------------------------------------------------------- one huge row


def _huge_row(tmp_path: Path, chars: int = 3_000_000) -> Path:
    """A few MB of completion beside a short row: enough to prove the cap (30 MB took >12 GB)."""
    rows = [
        {"prompt": "rev:ab>", "completion": "ba"},
        {"prompt": "rev:x>", "completion": "x" * chars},
    ]
    return write_jsonl(tmp_path / "huge.jsonl", rows)


@pytest.fixture
def tokenised_chars(monkeypatch):
    """The longest text any tokenizer was asked to tokenise (the work done is bounded)."""
    from transformers import PreTrainedTokenizerBase

    seen = [0]
    real = PreTrainedTokenizerBase.__call__

    def spy(self, text=None, *args, **kwargs):
        texts = text if isinstance(text, list) else [text]
        seen[0] = max([seen[0], *(len(t) for t in texts if isinstance(t, str))])
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", spy)
    return seen


def test_a_huge_row_is_cut_by_characters_before_it_is_tokenised(tmp_path, tok, tokenised_chars):
    from moetune.data.cap import char_cap

    cap = char_cap(tok, 32).chars
    data = _load(_huge_row(tmp_path), tok, seq_len=32)
    assert data.overlong == 1
    assert len(data.dataset[1]["completion"]) == cap - len("rev:x>")  # the first cap characters
    assert data.dataset[1]["completion"] == "x" * (cap - len("rev:x>"))
    assert 0 < tokenised_chars[0] <= cap  # never the 3 MB


def test_a_huge_row_is_refused_by_line_without_tokenising_it(tmp_path, tok, tokenised_chars):
    err = _error(_huge_row(tmp_path, 300_000), tok, seq_len=32, overlong="error")
    assert "huge.jsonl line 2" in err.cause and "300,006 characters" in err.cause
    assert "not tokenised" in err.cause and "data.overlong=truncate" in err.fix
    assert tokenised_chars[0] < 100  # only the short row was


def test_preference_rows_are_cut_per_sequence(tok):
    from moetune.data.cap import Cap, capped

    row = {"prompt": "p" * 6, "chosen": "c" * 20, "rejected": "r" * 3}
    got = capped("src row 1", row, FORMATS["preference"], Cap(10, 2, 5), "truncate")
    assert got == {"prompt": "p" * 6, "chosen": "cccc", "rejected": "rrr"}  # 6 + 4 ≤ 10 each
    turns = [{"role": "user", "content": "u" * 20}, {"role": "assistant", "content": "a" * 20}]
    got = capped("src row 2", {"messages": turns}, FORMATS["messages"], Cap(30, 6, 5), "x")
    assert [t["content"] for t in got["messages"]] == ["u" * 20, "a" * 10]


def test_every_field_a_template_renders_counts_toward_the_cap(tok):
    """A 3 MB tool call `arguments` string counts (it was tokenised whole): cut in reading
    order under truncate, refused under error; roles and names are kept whole, uncounted."""
    from moetune.data.cap import Cap, capped

    call = {"type": "function", "function": {"name": "f", "arguments": "a" * 3_000_000}}
    turns = [{"role": "user", "content": "u" * 4},
             {"role": "assistant", "content": "", "tool_calls": [call]}]  # fmt: skip
    row, cap = {"messages": turns}, Cap(30, 6, 5)
    got = capped("src row 1", row, FORMATS["messages"], cap, "truncate")
    kept = got["messages"][1]["tool_calls"][0]
    assert kept["function"] == {"name": "f", "arguments": "a" * 26}  # 4 + 26 = the cap
    assert kept["type"] == "function" and got["messages"][0]["role"] == "user"
    with pytest.raises(DataError, match=r"3,000,004 characters"):
        capped("src row 1", row, FORMATS["messages"], cap, "error")
    named = {"messages": [{"role": "user", "content": "x", "name": "n" * 27}]}  # 4 + 27 > 30
    with pytest.raises(DataError, match="roles, names, paths"):
        capped("src row 2", named, FORMATS["messages"], cap, "truncate")
