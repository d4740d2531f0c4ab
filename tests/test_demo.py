"""The demo: skills, tokenizer, shipped base and greedy exact match (fast, offline)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from moetune.demo.base import SHIPPED_DIR, build_base, cache_dir, load_base, load_meta
from moetune.demo.evaluate import exact_match, scores_by_skill
from moetune.demo.skills import (
    SKILLS,
    Item,
    base_skills,
    make_items,
    new_skills,
    split_of,
    stream,
    to_prompt_completion,
    to_text,
    write_jsonl,
)
from moetune.demo.tokenizer import EOS, build_tokenizer, load_tokenizer, save_tokenizer

ALL = list(SKILLS)


def _arg(it: Item) -> str:
    """The argument between `name:` and the closing `>`."""
    assert it.prompt.startswith(f"{it.skill}:") and it.prompt.endswith(">")
    return it.prompt[len(it.skill) + 1 : -1]


def test_registry_has_base_and_new_skills() -> None:
    assert base_skills() == ["copy", "rev", "first", "sum", "kv"]
    assert set(new_skills()) >= {"last"}
    assert not set(base_skills()) & set(new_skills())


def test_items_are_deterministic_from_the_seed() -> None:
    assert make_items(ALL, 20, seed=3) == make_items(ALL, 20, seed=3)
    assert make_items(ALL, 20, seed=3) != make_items(ALL, 20, seed=4)
    first = [next(s) for s in [stream(ALL, 5)] for _ in range(50)]
    again = [next(s) for s in [stream(ALL, 5)] for _ in range(50)]
    assert first == again


def _check(it: Item) -> bool:
    """Solve each skill independently of skills.py."""
    arg = _arg(it)
    if it.skill == "rev":
        return it.answer[::-1] == arg and len(it.answer) == len(arg)
    if it.skill == "sum":
        return int(it.answer) == sum(ord(c) - ord("0") for c in arg)
    if it.skill == "kv":
        m = re.fullmatch(r"((?:[a-z]\d){2,4})\?([a-z])", arg)
        assert m is not None
        pairs = m.group(1)
        return pairs[pairs.index(m.group(2)) + 1] == it.answer
    if it.skill == "dup":
        return it.answer[::2] == arg and it.answer[1::2] == arg
    expected = {"copy": arg, "first": arg[:1], "last": arg[-1:]}[it.skill]
    return it.answer == expected


def test_answers_are_right() -> None:
    items = make_items(ALL, 100, seed=0, split="train")
    assert all(_check(it) for it in items)
    sums = make_items(["sum"], 300, seed=0)
    assert all(_check(it) for it in sums) and any(len(it.answer) == 2 for it in sums)


def test_train_and_eval_never_overlap() -> None:
    train = {it.prompt for it in make_items(ALL, 300, seed=0, split="train")}
    held = {it.prompt for it in make_items(ALL, 300, seed=0, split="eval")}
    assert len(held) == 300 * len(ALL)  # distinct within a split
    assert not train & held
    assert all(split_of(p) == "eval" for p in held)
    streamed = stream(ALL, 1)
    assert all(split_of(next(streamed).prompt) == "train" for _ in range(2000))


def test_rows_carry_an_end_marker(tmp_path: Path) -> None:
    items = make_items(["rev"], 3, seed=0)
    rows = to_prompt_completion(items)
    assert rows[0] == {"prompt": items[0].prompt, "completion": items[0].answer + EOS}
    assert to_text(items, end="\n")[1] == {"text": items[1].prompt + items[1].answer + "\n"}
    path = write_jsonl(tmp_path / "d" / "rows.jsonl", rows)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows


def test_tokenizer_round_trips_every_skill(tmp_path: Path) -> None:
    save_tokenizer(build_tokenizer(), tmp_path)
    tok = load_tokenizer(tmp_path)
    for it in make_items(ALL, 20, seed=1):
        text = it.prompt + it.answer
        ids = tok(text + EOS, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text) + 1  # one id per character, then EOS
        assert ids[-1] == tok.eos_token_id and tok.unk_token_id not in ids
        assert tok.decode(ids, skip_special_tokens=True) == text
    batch = tok(["ab", "abcd"], padding=True)
    assert batch["input_ids"][0][2:] == [tok.pad_token_id] * 2
    assert batch["attention_mask"][0] == [1, 1, 0, 0]
    assert len({tok.pad_token_id, tok.eos_token_id, tok.bos_token_id}) == 3


@pytest.fixture(scope="module")
def shipped() -> Iterator[tuple[object, object]]:
    torch.manual_seed(0)
    yield load_base()


def test_shipped_files_are_small_and_described() -> None:
    files = {p.name: p.stat().st_size for p in SHIPPED_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "meta.json"} <= set(files)
    assert sum(files.values()) < 4 * 2**20
    meta = load_meta()
    assert meta["base_skills"] == base_skills()
    assert meta["command"].startswith("python -m moetune.demo.base")
    assert meta["scores"]["copy"] >= 0.9 and meta["scores"]["last"] < 0.2


def test_shipped_base_knows_base_skills_but_not_new_ones(shipped: tuple) -> None:
    model, tok = shipped
    assert model.config.model_type == "qwen3_moe" and model.config.num_experts_per_tok == 2
    items = make_items(["copy", "rev", "first", "last"], 32, seed=123)
    scores = scores_by_skill(items, exact_match(model, tok, items))
    assert min(scores["copy"], scores["rev"], scores["first"]) >= 0.8, scores
    assert scores["last"] < 0.2, scores


def test_exact_match_is_per_item(shipped: tuple) -> None:
    model, tok = shipped
    good = make_items(["copy"], 4, seed=7)
    wrong = [Item(it.skill, it.prompt, it.answer + "z") for it in good]
    result = exact_match(model, tok, [*good, *wrong])
    assert len(result) == 8 and all(isinstance(r, bool) for r in result)
    assert result[4:] == [False] * 4
    assert sum(result[:4]) >= 3


def test_peft_lora_reaches_the_experts_of_the_shipped_base() -> None:
    from peft import LoraConfig, get_peft_model

    model, tok = load_base()  # a fresh copy: peft injects layers in place
    ids = tok("copy:abc>", return_tensors="pt")["input_ids"]
    before = model(input_ids=ids).logits
    cfg = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    peft_model = get_peft_model(model, cfg)
    names = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert any("experts" in n for n in names) and any("q_proj" in n for n in names)
    after = peft_model(input_ids=ids).logits  # lora_B starts at zero: same function
    torch.testing.assert_close(after, before)


def test_build_base_is_deterministic_and_loadable(tmp_path: Path) -> None:
    metas = [
        build_base(tmp_path / name, seed=1, steps=3, progress=False, eval_n=4) for name in "ab"
    ]
    weights = [(tmp_path / name / "model.safetensors").read_bytes() for name in "ab"]
    assert weights[0] == weights[1]
    assert metas[0]["scores"].keys() == set(SKILLS) and "--steps 3" in metas[0]["command"]
    assert json.loads((tmp_path / "a" / "meta.json").read_text())["seed"] == 1
    model, tok = load_base(tmp_path / "a")
    assert model.dtype == torch.float32 and len(tok) == model.config.vocab_size
    assert not list(tmp_path.glob(".*tmp*"))  # the temp dir was swapped in, not left over


def test_cache_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "moetune" / "demo-base"
