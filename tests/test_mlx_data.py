"""`lora.stack: mlx` reads data.sources through the torch stack's data path: the rows in
mlx/data are the rows the torch stack trains and evaluates on, in the same order (mixtures,
formats, the eval split), and data.chat_template renders them in mlx-lm as in TRL."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from moetune.config import parse_config
from moetune.data import SFT_FORMATS, DataError, load_train_data
from moetune.demo.base import MAX_LEN, SHIPPED_DIR
from moetune.train.errors import TrainError
from moetune.train.mlx.data import mlx_rows, write_rows

# u:… a:…<eos>, the generation prompt a: – characters the demo tokenizer knows
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _config(tmp: Path, data: dict[str, Any]) -> Any:
    return parse_config({
        "model": {"id": str(SHIPPED_DIR), "dtype": "float32"},
        "lora": {"stack": "mlx", "rank": 4},
        "data": data,
        "output": {"dir": str(tmp / "run")},
        "train": {"seq_len": MAX_LEN, "seed": 7, "device": "cpu"},
    })  # fmt: skip


def _tok() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SHIPPED_DIR)


def _written(cfg: Any, tmp: Path) -> tuple[list[Any], list[Any]]:
    """The mlx stack's train.jsonl and valid.jsonl, read back."""
    write_rows(tmp / "data", mlx_rows(cfg, SFT_FORMATS))
    read = [(tmp / "data" / f"{n}.jsonl").read_text().splitlines() for n in ("train", "valid")]
    return [json.loads(x) for x in read[0]], [json.loads(x) for x in read[1]]


def test_mixed_sources_and_eval_split_are_the_torch_stacks_rows(tmp_path: Path) -> None:
    """Two sources at weights 2 and 0.5, an eval share carved by hash: mlx-lm gets the
    rows TRL gets, in TRL's order, and the held-out rows as its validation set."""
    a = [{"prompt": f"copy:{c}{n}>", "completion": f"{c}{n}"} for c in "abcde" for n in range(4)]
    b = [{"question": f"rev:{c}{n}?", "answer": f"{n}{c}"} for c in "vwxyz" for n in range(2)]
    columns = {"prompt": "question", "completion": "answer"}
    sources = [{"path": _jsonl(tmp_path / "a.jsonl", a), "weight": 2},
               {"path": _jsonl(tmp_path / "b.jsonl", b), "weight": 0.5,
                "format": "prompt_completion", "columns": columns}]  # fmt: skip
    cfg = _config(tmp_path, {"sources": sources, "eval_fraction": 0.25})
    train, held = load_train_data(cfg.data, _tok(), MAX_LEN, SFT_FORMATS, cfg.train.seed)
    assert held is not None
    mlx_train, mlx_valid = _written(cfg, tmp_path)
    assert mlx_train == train.dataset.to_list() and mlx_valid == held.dataset.to_list()
    kept = {r["prompt"] for r in mlx_train}
    assert any(p.startswith("rev:") for p in kept) and any(p.startswith("copy:") for p in kept)
    assert not kept & {r["prompt"] for r in mlx_valid}  # the eval split is held out
    assert len(mlx_train) + len(mlx_valid) > len(a) + len(b) // 2  # weight 2 repeats rows


def test_without_an_eval_set_the_first_train_rows_validate(tmp_path: Path) -> None:
    rows = [{"text": f"copy:{c}>{c}"} for c in "abcdefgh"]
    cfg = _config(tmp_path, {"train_file": _jsonl(tmp_path / "t.jsonl", rows)})
    train, valid = _written(cfg, tmp_path)
    assert train == rows and valid == rows  # one source at weight 1 keeps its order


def test_streaming_is_refused_before_a_file_is_written(tmp_path: Path) -> None:
    from moetune.train.mlx.stack import train_mlx

    path = _jsonl(tmp_path / "t.jsonl", [{"text": "abc"}])
    cfg = _config(tmp_path, {"sources": [{"path": path}], "streaming": True})
    with pytest.raises(TrainError, match=r"cannot stream data\.sources"):
        train_mlx(cfg, False, False, (False, False), False)
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_chat_template_renders_messages_as_in_the_torch_stack(tmp_path: Path) -> None:
    """data.chat_template on messages rows: mlx-lm's tokens and prompt mask from the
    converted model's tokenizer are the ids and the first assistant token TRL trains on."""
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'moetune[mlx]')")
    from mlx_lm.tuner.datasets import ChatDataset
    from mlx_lm.utils import load_tokenizer

    from moetune.train.mlx.base import hf_to_mlx, set_chat_template

    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    turns = [[{"role": "user", "content": f"copy:{w}"}, {"role": "assistant", "content": w}]
             for w in ("ab", "cde", "f")]  # fmt: skip
    data = {"sources": [{"path": _jsonl(tmp_path / "m.jsonl", [{"messages": t} for t in turns])}],
            "chat_template": str(tmp_path / "chat.jinja")}  # fmt: skip
    cfg = _config(tmp_path, data)
    torch_rows = load_train_data(cfg.data, _tok(), MAX_LEN, SFT_FORMATS, 7)[0].dataset.to_list()
    rows = mlx_rows(cfg, SFT_FORMATS)
    hf_to_mlx(SHIPPED_DIR, tmp_path / "model")
    assert rows.template is not None
    set_chat_template(tmp_path / "model", rows.template)
    mlx_tok = load_tokenizer(tmp_path / "model")
    chat = ChatDataset(rows.train, mlx_tok, mask_prompt=True)
    for row, want in zip(rows.train, torch_rows, strict=True):
        ids, offset = chat.process(row)
        assert ids == want["input_ids"] and offset == want["assistant_masks"].index(1)


def test_conversational_prompt_completion_rows_become_one_conversation(tmp_path: Path) -> None:
    """mlx-lm's prompt/completion reader wraps a string in one user turn; turns go as one
    messages row instead (prompt turns, then the completion's), with the base's template."""
    rows = [{"prompt": [{"role": "user", "content": f"copy:{c}"}],
             "completion": [{"role": "assistant", "content": c}]} for c in "abc"]  # fmt: skip
    cfg = _config(tmp_path, {"sources": [{"path": _jsonl(tmp_path / "c.jsonl", rows)}]})
    got = mlx_rows(cfg, SFT_FORMATS)
    assert got.train == [{"messages": r["prompt"] + r["completion"]} for r in rows]
    assert got.template is None and got.masks_prompt  # mlx-lm masks all but the completion


def test_a_huge_row_is_cut_as_the_torch_stack_cuts_it_before_mlx_lm_reads_it(
    tmp_path: Path,
) -> None:
    from moetune.data.cap import char_cap

    rows = [{"prompt": "rev:ab>", "completion": "ba"}, {"prompt": "x>", "completion": "y" * 10**6}]
    cfg = _config(tmp_path, {"sources": [{"path": _jsonl(tmp_path / "h.jsonl", rows)}]})
    cap = char_cap(_tok(), MAX_LEN)
    torch_rows = load_train_data(cfg.data, _tok(), MAX_LEN, SFT_FORMATS, 7)[0].dataset.to_list()
    got = mlx_rows(cfg, SFT_FORMATS, cap)
    assert got.train == torch_rows  # the same cut row, not the megabyte
    assert len(got.train[1]["completion"]) == cap.chars - len("x>")
    refuse = cfg.model_copy(update={"data": cfg.data.model_copy(update={"overlong": "error"})})
    with pytest.raises(DataError) as info:
        mlx_rows(refuse, SFT_FORMATS, cap)
    assert "h.jsonl line 2: 1,000,002 characters" in info.value.cause


@pytest.mark.parametrize(
    ("source", "why"),
    [({"weight": 0.01}, "keeps 0 of its 4 rows"), ({"weight": ".inf"}, "at most 1000")],
)
def test_mlx_stack_refuses_bad_sources_in_one_line_before_any_file(tmp_path, source, why):
    """Issue 36 item 8: the mlx stack on data.sources was exit 3 (AssertionError); it now reads
    them through the torch stack's checks, so a bad source is one line and no run dir."""
    import yaml
    from typer.testing import CliRunner

    from moetune.cli import app

    rows = [{"prompt": f"rev:{w}>", "completion": w[::-1]} for w in ("ab", "cd", "ef", "gh")]
    path = _jsonl(tmp_path / "a.jsonl", rows)
    weight = source["weight"]
    text = yaml.safe_dump({"model": {"id": str(SHIPPED_DIR)}, "lora": {"stack": "mlx"},
                           "output": {"dir": str(tmp_path / "run"),
                                      "ledger": str(tmp_path / "ledger.jsonl")}})  # fmt: skip
    text += f"data: {{sources: [{{path: {path}}}, {{path: {path}, weight: {weight}}}]}}\n"
    (tmp_path / "run.yaml").write_text(text)
    got = CliRunner().invoke(app, ["train", str(tmp_path / "run.yaml")])
    assert got.exit_code == 2 and "Traceback" not in got.output, got.output
    assert why in got.stderr and "fix:" in got.stderr
    assert not (tmp_path / "run").exists()
