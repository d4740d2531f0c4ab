"""Issue 48 (fifth hardening pass), data: a key stated twice in a row is refused through
every reader as the jsonl reader refuses it – csv, arrow and parquet headers, a dir of jsonl
read by `datasets`, and data.streaming – never renamed, dropped or left as exit 3."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pyarrow as pa
import pytest

from moetune.config import DataArgs
from moetune.data import check_sources
from moetune.data.errors import DataError

SFT = ("messages", "prompt/completion", "text")


def _refused(path: Path, streaming: bool) -> DataError:
    with pytest.raises(DataError) as info:
        check_sources(DataArgs(sources=[{"path": str(path)}], streaming=streaming), SFT)
    assert "\n" not in str(info.value) and "keep one of the two values" in info.value.fix
    return info.value


def _csv(path: Path) -> Path:
    with path.open("w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([["text", "text"], ["rev:ab>ba", "rev:cd>dc"]])
    return path


def _arrow(path: Path, stream: bool) -> Path:
    table = pa.table([pa.array(["rev:ab>ba"]), pa.array(["rev:cd>dc"])], names=["text", "text"])
    with pa.OSFile(str(path), "wb") as sink:
        new = pa.ipc.new_stream if stream else pa.ipc.new_file
        with new(sink, table.schema) as writer:
            writer.write_table(table)
    return path


@pytest.mark.parametrize("streaming", [False, True])
def test_a_csv_with_two_columns_of_one_name_is_refused(tmp_path, streaming):
    err = _refused(_csv(tmp_path / "rows.csv"), streaming)  # was: trained on `text` alone
    assert "column 'text' appears twice" in err.cause and "rows.csv" in err.cause
    (tmp_path / "dir").mkdir()
    _csv(tmp_path / "dir" / "train.csv")
    assert "column 'text' appears twice" in _refused(tmp_path / "dir", streaming).cause


@pytest.mark.parametrize("stream_format", [True, False])
@pytest.mark.parametrize("streaming", [False, True])
def test_an_arrow_file_with_two_fields_of_one_name_is_refused(tmp_path, streaming, stream_format):
    err = _refused(_arrow(tmp_path / "rows.arrow", stream_format), streaming)  # was: KeyError
    assert "column 'text' appears twice" in err.cause


@pytest.mark.parametrize("streaming", [False, True])
def test_a_duplicate_key_in_jsonl_read_by_datasets_is_refused_as_the_jsonl_reader_does(
    tmp_path, streaming
):
    (tmp_path / "dir").mkdir()
    rows = '{"text": "rev:ab>ba"}\n{"text": "kept?", "text": "or this?"}\n'
    (tmp_path / "dir" / "train.jsonl").write_text(rows, encoding="utf-8")
    (tmp_path / "rows.jsonl").write_text(rows, encoding="utf-8")
    for path in (tmp_path / "dir", tmp_path / "rows.jsonl"):
        if path.is_file() and not streaming:
            continue  # read by moetune's own reader (tests/test_hardening_4_data.py)
        err = _refused(path, streaming)  # streaming was ArrowInvalid: exit 3
        assert "key 'text' appears twice in one object" in err.cause


def test_distinct_columns_still_read(tmp_path):
    path = tmp_path / "rows.csv"
    with path.open("w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([["prompt", "completion"], ["rev:ab>", "ba"]])
    (part,), _ = check_sources(DataArgs(sources=[{"path": str(path)}]), SFT)
    assert [row for _, row in part.rows] == [{"prompt": "rev:ab>", "completion": "ba"}]


def _unwritable_cache(tmp_path: Path) -> Path:
    """A cache path under HOME read-only: chmod 555, or (root passes permission bits) sysfs."""
    from moetune.io import unwritable

    if os.geteuid() != 0:
        home = tmp_path / "home"
        home.mkdir(mode=0o555)
        return home / ".cache" / "huggingface" / "datasets"
    if unwritable(Path("/sys/kernel")) is None:
        pytest.skip("no dir here refuses root's writes")
    return Path("/sys/kernel/.cache/huggingface/datasets")


@pytest.mark.parametrize("streaming", [False, True])
def test_a_read_only_datasets_cache_falls_back_for_local_files(tmp_path, monkeypatch, streaming):
    from datasets import config

    monkeypatch.setattr(config, "HF_DATASETS_CACHE", _unwritable_cache(tmp_path))
    path = tmp_path / "rows.csv"
    with path.open("w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([["prompt", "completion"], ["rev:ab>", "ba"]])
    data = DataArgs(sources=[{"path": str(path)}], streaming=streaming)
    (part,), _ = check_sources(data, SFT)  # was: "cannot be read ([Errno 1] … '.cache')"
    assert [row for _, row in part.rows] == [{"prompt": "rev:ab>", "completion": "ba"}]


def test_a_hub_dataset_with_a_read_only_cache_names_the_cache(tmp_path, monkeypatch):
    from datasets import config

    cache = _unwritable_cache(tmp_path)
    monkeypatch.setattr(config, "HF_DATASETS_CACHE", cache)
    with pytest.raises(DataError) as info:
        check_sources(DataArgs(sources=[{"path": "someone/rows"}]), SFT)
    assert f"the datasets cache {cache} cannot be written" in info.value.cause
    assert "HF_DATASETS_CACHE" in info.value.fix
