"""data.sources: hub ids (through the real offline cache path of `datasets`), local dirs
and files of every kind, ShareGPT / Alpaca / mapped columns, weighted mixing with the seed
(the same rows in the same order for a resume and on every rank) and the eval split carved
by a row hash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import DataArgs, SourceArgs
from moetune.data import DataError, check_sources, load_train_data
from moetune.data.mix import held_out
from moetune.demo.tokenizer import build_tokenizer
from test_train_helpers import reverse_rows, write_jsonl


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _rows(n: int, tag: str) -> list[dict[str, str]]:
    return [{"prompt": f"{tag}{i}>", "completion": f"{i}{tag}"} for i in range(n)]


def _load(tok, seed: int = 0, **data):
    return load_train_data(DataArgs(**data), tok, 64, seed=seed)


def _prompts(data) -> list[str]:
    return list(data.dataset["prompt"])


def _parquet_dir(root: Path, shards: list[list[dict]]) -> Path:
    root.mkdir(parents=True)
    for n, rows in enumerate(shards):
        pq.write_table(pa.Table.from_pylist(rows), root / f"part-{n}.parquet")
    return root


# ---------------------------------------------------------------- kinds of source


def test_a_parquet_dir_reads_every_shard(tmp_path, tok):
    folder = _parquet_dir(tmp_path / "pq", [_rows(3, "a"), _rows(4, "b")])
    train, _ = _load(tok, sources=[{"path": str(folder)}])
    assert (train.rows, train.format) == (7, "prompt/completion")
    assert sorted(_prompts(train)) == sorted(r["prompt"] for r in _rows(3, "a") + _rows(4, "b"))


@pytest.mark.parametrize("streaming", [False, True])
def test_a_mixed_dir_reads_every_file_of_every_kind(tmp_path, tok, streaming):
    """datasets alone reads the most common kind of a dir (here the parquet) and drops the
    jsonl without a word; every row of both is trained on."""
    folder = _parquet_dir(tmp_path / "mixed", [_rows(3, "p")])
    write_jsonl(folder / "more.jsonl", _rows(2, "j"))
    (folder / "README.md").write_text("# a dataset card, not rows\n", encoding="utf-8")
    (folder / "img.png").write_bytes(b"not rows either")
    train, _ = _load(tok, sources=[{"path": str(folder)}], streaming=streaming)
    got = [r["prompt"] for r in train.dataset]
    assert sorted(got) == sorted(r["prompt"] for r in _rows(3, "p") + _rows(2, "j"))


def test_a_dir_file_of_a_kind_not_read_is_named_before_anything_is_built(tmp_path, tok):
    from moetune.data import DataError

    folder = _parquet_dir(tmp_path / "mixed", [_rows(3, "p")])
    (folder / "notes.txt").write_text("rev:ab>ba\n", encoding="utf-8")
    (folder / "extra.tsv").write_text("prompt\tcompletion\nq>\ta\n", encoding="utf-8")
    with pytest.raises(DataError) as info:
        _load(tok, sources=[{"path": str(folder)}])
    assert "extra.tsv, notes.txt would not be read" in info.value.cause
    assert "move them out of" in info.value.fix and "\n" not in str(info.value)
    only_text = tmp_path / "text"  # alone as beside rows: the same refusal (issue 48 item 8)
    only_text.mkdir()
    (only_text / "a.txt").write_text("rev:ab>ba\nrev:cd>dc\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"a\.txt would not be read"):
        _load(tok, sources=[{"path": str(only_text)}])


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.csv"])
def test_a_split_or_subset_on_a_single_file_is_refused_not_ignored(tmp_path, tok, name):
    """A file has no splits: `split: test` on one used to train on the whole file."""
    from moetune.data import DataError

    path = tmp_path / name
    if name.endswith(".csv"):
        path.write_text("prompt,completion\na>,b\n", encoding="utf-8")
    else:
        write_jsonl(path, _rows(2, "a"))
    for over in ({"split": "test"}, {"name": "subset"}):
        with pytest.raises(DataError) as info:
            _load(tok, sources=[{"path": str(path), **over}])
        assert "is one file" in info.value.cause and "drop split: / name:" in info.value.fix
    train, _ = _load(tok, sources=[{"path": str(path)}])  # the default split stays legal
    assert train.rows >= 1


def test_a_json_dir_a_csv_with_mapped_columns_and_a_saved_dataset(tmp_path, tok):
    from datasets import Dataset, DatasetDict

    (tmp_path / "js").mkdir()
    write_jsonl(tmp_path / "js" / "x.jsonl", _rows(2, "j"))
    csv = tmp_path / "qa.csv"
    csv.write_text("question,answer\nq1>,a1\nq2>,a2\nq3>,a3\n", encoding="utf-8")
    saved = tmp_path / "saved"
    DatasetDict({"train_sft": Dataset.from_list(_rows(5, "s"))}).save_to_disk(str(saved))
    sources = [
        {"path": str(tmp_path / "js")},
        {"path": str(csv), "columns": {"prompt": "question", "completion": "answer"}},
        {"path": str(saved), "split": "train_sft", "max_rows": 4},
    ]
    train, _ = _load(tok, sources=sources)
    assert train.rows == 2 + 3 + 4
    assert [s["rows"] for s in train.sources] == [2, 3, 4]
    assert {"q2>", "j1>", "s3>"} <= set(_prompts(train)) and "s4>" not in _prompts(train)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A hub dataset laid out in HF_DATASETS_CACHE as `load_dataset("moetune-test/qa")`
    leaves it (the parquet builder's arrow files under <owner>___<name>/<config>/<version>/
    <commit>), with the hub offline: the real lookup of `load_dataset` then finds it there."""
    import datasets.config
    from datasets.packaged_modules.parquet.parquet import Parquet

    shards = _parquet_dir(tmp_path / "download", [_rows(6, "h")])
    cache = tmp_path / "hf_datasets"
    builder = Parquet(cache_dir=str(cache), dataset_name="qa", hash="c0ffee" * 6,
                      data_files={"train_sft": str(shards / "part-0.parquet")})  # fmt: skip
    builder.download_and_prepare()
    # where the hub's parquet export of "moetune-test/qa" (config "default") is cached
    (cache / "moetune-test___qa").mkdir()
    next((cache / "qa").glob("default-*")).rename(cache / "moetune-test___qa" / "default")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return "moetune-test/qa"


def test_a_hub_id_is_read_from_the_cache_offline(hub_cache, tok):
    train, _ = _load(tok, sources=[{"path": hub_cache, "split": "train_sft"}])
    assert train.rows == 6 and "h5>" in _prompts(train)
    assert train.sources[0]["source"] == "moetune-test/qa [train_sft]"


def test_sharegpt_and_alpaca_become_messages(tmp_path, tok):
    tok = build_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
    share = [{"conversations": [{"from": "human", "value": "ab"}, {"from": "gpt", "value": "ba"}]}]
    alpaca = [{"instruction": "rev", "input": "cd", "output": "dc", "system": "be"}]
    sources = [
        {"path": str(write_jsonl(tmp_path / "s.jsonl", share))},
        {"path": str(write_jsonl(tmp_path / "a.jsonl", alpaca)), "format": "alpaca"},
    ]
    train, _ = _load(tok, sources=sources, completion_only_loss=False)
    assert train.format == "messages"
    turns = sorted(train.dataset["messages"], key=len)
    assert [(m["role"], m["content"]) for m in turns[0]] == [("user", "ab"), ("assistant", "ba")]
    assert [m["role"] for m in turns[1]] == ["system", "user", "assistant"]
    assert turns[1][1]["content"] == "rev\n\ncd"


# ---------------------------------------------------------------- mixing and the eval split


def _two(tmp_path: Path, wa: float, wb: float) -> list[dict]:
    a = write_jsonl(tmp_path / "a.jsonl", _rows(10, "a"))
    b = write_jsonl(tmp_path / "b.jsonl", _rows(8, "b"))
    return [{"path": str(a), "weight": wa}, {"path": str(b), "weight": wb}]


def test_weights_repeat_or_sample_rows_and_the_seed_orders_them(tmp_path, tok):
    train, _ = _load(tok, sources=_two(tmp_path, 2, 0.5))
    prompts = _prompts(train)
    assert train.rows == 20 + 4
    assert sum(p.startswith("a") for p in prompts) == 20 and len(set(prompts)) == 14
    again, _ = _load(tok, sources=_two(tmp_path, 2, 0.5))
    assert _prompts(again) == prompts and again.sha256 == train.sha256  # a resume: same order
    other, _ = _load(tok, seed=1, sources=_two(tmp_path, 2, 0.5))
    assert _prompts(other) != prompts and other.sha256 != train.sha256


RANK = """
import json, sys
from moetune.config import DataArgs
from moetune.data import load_train_data
from moetune.demo.tokenizer import build_tokenizer
train, _ = load_train_data(DataArgs(**json.loads(sys.argv[1])), build_tokenizer(), 64, seed=7)
print(json.dumps([train.sha256, list(train.dataset["prompt"])]))
"""


def test_every_process_mixes_the_same_rows_in_the_same_order(tmp_path):
    """Ranks are processes: other hash seeds must not change the mix."""
    args = json.dumps({"sources": _two(tmp_path, 1.5, 1), "eval_fraction": 0.2})
    outs = []
    for hashseed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed, "HF_HUB_OFFLINE": "1"}
        done = subprocess.run([sys.executable, "-c", RANK, args], env=env, capture_output=True,
                              text=True, check=True, timeout=300)  # fmt: skip
        outs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert outs[0] == outs[1] and len(outs[0][1]) > 10


def test_eval_rows_are_carved_by_their_hash_whatever_the_order(tmp_path, tok):
    rows = _rows(40, "e")
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    train, held = _load(tok, train_file=str(path), eval_fraction=0.25)
    assert held is not None and train.rows + held.rows == 40 and 0 < held.rows < 20
    assert not set(_prompts(train)) & set(_prompts(held))
    assert set(_prompts(held)) == {r["prompt"] for r in rows if held_out(r, 0.25)}
    write_jsonl(path, rows[::-1])
    _, flipped = _load(tok, seed=3, train_file=str(path), eval_fraction=0.25)
    assert set(_prompts(flipped)) == set(_prompts(held))


def test_named_eval_sources_and_one_format_for_all(tmp_path, tok):
    a, _ = _two(tmp_path, 1, 1)
    held = write_jsonl(tmp_path / "h.jsonl", _rows(3, "h"))
    train, ev = _load(tok, sources=[a], eval_sources=[{"path": str(held)}])
    assert (train.rows, ev.rows) == (10, 3)
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "copy:a>a"}])
    with pytest.raises(Exception, match="holds text rows but"):
        _load(tok, sources=[a, {"path": str(text)}])


def test_streaming_interleaves_every_row_by_weight(tmp_path, tok):
    folder = _parquet_dir(tmp_path / "pq", [_rows(5, "p")])
    jsonl = write_jsonl(tmp_path / "j.jsonl", _rows(4, "j"))
    sources = [{"path": str(folder)}, {"path": str(jsonl)}]
    train, _ = _load(tok, sources=sources, streaming=True)
    assert train.streamed and train.dataset.__class__.__name__ == "IterableDataset"
    got = [r["prompt"] for r in train.dataset]
    assert sorted(got) == sorted(r["prompt"] for r in _rows(5, "p") + _rows(4, "j"))
    assert [r["prompt"] for r in _load(tok, sources=sources, streaming=True)[0].dataset] == got


def test_train_file_is_the_one_source_shorthand(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", reverse_rows(5))
    assert DataArgs(train_file=str(path)).train_sources() == [SourceArgs(path=str(path))]
    assert _prompts(_load(tok, train_file=str(path))[0]) == [r["prompt"] for r in reverse_rows(5)]


def test_a_remote_run_takes_local_sources_and_the_template_file_along(tmp_path):
    from moetune.config import parse_config
    from moetune.lane.stage import staging

    folder = _parquet_dir(tmp_path / "pq", [_rows(2, "p")])
    held = write_jsonl(tmp_path / "h.jsonl", _rows(2, "h"))
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}", encoding="utf-8")
    data = {"sources": [{"path": str(folder)}, {"path": "owner/name", "split": "train_sft"}],
            "eval_sources": [{"path": str(held)}], "chat_template": str(template)}  # fmt: skip
    out = staging(parse_config({"data": data}))
    pod = out.config.data
    assert [s.path for s in pod.sources] == ["data/sources/0", "owner/name"]
    assert pod.eval_sources[0].path == "data/eval_sources/0.jsonl"
    assert pod.chat_template == "data/chat_template.jinja"
    assert set(out.files) == {(folder, "data/sources/0"), (held, "data/eval_sources/0.jsonl"),
                              (template, "data/chat_template.jinja")}  # fmt: skip


def test_streaming_trains_end_to_end_with_every_default_but_max_steps(tmp_path):
    """routing_every, expert selection and the rest at their defaults: the base's routing is
    measured on the stream's first rows (an IterableDataset has no len())."""
    import json as json_

    from moetune.config import parse_config
    from moetune.train import train
    from test_train_helpers import one_thread, save_tiny_model

    model = save_tiny_model(tmp_path / "m")
    data = write_jsonl(tmp_path / "d.jsonl", reverse_rows(8))
    cfg = parse_config({
        "model": {"id": str(model)},
        "data": {"train_file": str(data), "streaming": True},
        "train": {"max_steps": 2, "device": "cpu", "seq_len": 32},
        "output": {"dir": str(tmp_path / "out"), "ledger": str(tmp_path / "ledger.jsonl")},
    })  # fmt: skip
    assert cfg.train.routing_every  # the default that needed a length
    with one_thread():
        result = train(cfg, progress=False)
    assert result.steps == 2
    summary = json_.loads((Path(result.run_dir) / "summary.json").read_text())
    assert summary["routing"]["base"]  # measured on the streamed rows
    assert (Path(result.adapter_dir) / "adapter_model.safetensors").is_file()


def test_streaming_trains_dpo_and_grpo_rows_too(tmp_path):
    """The methods that read columns (GRPO's rewards) or prompts (the base's routing) read a
    streamed set's first rows: it names no columns and has no length."""
    from moetune.config import parse_config
    from moetune.train import train
    from test_train_helpers import one_thread, save_tiny_model

    model = save_tiny_model(tmp_path / "m")
    words = ["abc", "xyz", "moe", "lora"] * 2
    rows = {
        "dpo": [{"prompt": f"rev:{w}>", "chosen": w[::-1], "rejected": w} for w in words],
        "grpo": [{"prompt": f"rev:{w}>", "answer": w[::-1]} for w in words],
    }
    for method, data in rows.items():
        cfg = parse_config({
            "model": {"id": str(model)},
            "data": {"train_file": str(write_jsonl(tmp_path / f"{method}.jsonl", data)),
                     "streaming": True},
            "train": {"method": method, "max_steps": 1, "device": "cpu", "seq_len": 32,
                      "batch_size": 4, "grpo": {"num_generations": 2, "max_completion_length": 4}},
            "output": {"dir": str(tmp_path / method), "ledger": str(tmp_path / "ledger.jsonl")},
        })  # fmt: skip
        with one_thread():
            assert train(cfg, progress=False).steps == 1, method


# ---------------------------------------------------------------- issue 36 item 8: weights


@pytest.mark.parametrize("weight", [".inf", "1e300", "1001"])
def test_a_source_weight_past_1000_or_inf_is_refused_at_the_config(tmp_path, weight):
    """weight .inf was exit 3 (ValueError: cannot convert float NaN) in `data` and `train`."""
    data = write_jsonl(tmp_path / "a.jsonl", _rows(8, "a"))
    run = tmp_path / "run.yaml"
    run.write_text(f"model: {{id: x}}\ndata: {{sources: [{{path: {data}, weight: {weight}}}]}}\n")
    result = CliRunner().invoke(app, ["data", str(run)])
    assert result.exit_code == 2
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) <= 2
    assert "weight must be at most 1000" in result.stderr


def test_a_weight_that_keeps_no_row_is_refused_naming_the_least_that_keeps_one(tmp_path, tok):
    """weight 0.01 of 8 rows keeps round(0.08) = 0 of them: exit 3 (IndexError) in `train`,
    an empty mix in `data`; now one line with the smallest weight that keeps a row."""
    a = write_jsonl(tmp_path / "a.jsonl", _rows(8, "a"))
    b = write_jsonl(tmp_path / "b.jsonl", _rows(8, "b"))
    sources = [{"path": str(a)}, {"path": str(b), "weight": 0.01}]
    with pytest.raises(DataError, match=r"weight 0\.01 keeps 0 of its 8 rows") as err:
        check_sources(DataArgs(sources=sources))
    assert "at least 0.125" in err.value.fix
    sources[1]["weight"] = 0.125  # round(1.0): one row of b, and the run goes on
    got, _ = _load(tok, sources=sources)
    assert sum(p.startswith("b") for p in _prompts(got)) == 1


def test_a_weight_that_keeps_no_row_once_the_eval_share_is_carved_is_refused(tmp_path, tok):
    rows = write_jsonl(tmp_path / "a.jsonl", _rows(40, "a"))
    kept = sum(not held_out(r, 0.45) for r in _rows(40, "a"))
    assert round(40 * 0.015) == 1 and round(kept * 0.015) == 0  # 40 rows: 1; once carved: 0
    sources = [{"path": str(rows), "weight": 0.015}]
    check_sources(DataArgs(sources=sources, eval_fraction=0.45))  # whole, it keeps one
    with pytest.raises(DataError, match=f"keeps 0 of its {kept} rows"):
        _load(tok, sources=sources, eval_fraction=0.45)
