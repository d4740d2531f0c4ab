"""The GGUF vocabulary moetune writes for a character tokenizer (the demo base's), which
llama.cpp's stock converter refuses: read back with the gguf package, it encodes every
eval prompt to the ids the transformers tokenizer gives, in llama.cpp's byte-level form."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from moetune.demo.base import SHIPPED_DIR
from moetune.demo.skills import SKILLS, make_items
from moetune.demo.tokenizer import load_tokenizer
from moetune.export.gguf_vocab import (
    BYTE_CHARS,
    CONTROL,
    NORMAL,
    UNUSED,
    byte_level,
    char_vocab,
    with_implied,
    write_vocab,
)


class _NoSpecials:
    def add_to_gguf(self, writer: gguf.GGUFWriter) -> None:
        writer.add_eos_token_id(1)


def _written(tmp_path: Path, vocab_size: int) -> gguf.GGUFReader:
    found = char_vocab(SHIPPED_DIR)
    assert found is not None
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    write_vocab(writer, found, vocab_size, _NoSpecials())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return gguf.GGUFReader(str(path))


def test_byte_level_is_gpt2s_map() -> None:
    assert byte_level(" ") == "Ġ" and byte_level("a:1>") == "a:1>"  # space is U+0120
    assert len(set(BYTE_CHARS.values())) == 256  # a bijection over the bytes
    assert byte_level("\n") == "Ċ" and byte_level("é") == "Ã©"  # two bytes, two chars


def test_the_written_vocab_encodes_prompts_as_the_tokenizer_does(tmp_path: Path) -> None:
    reader = _written(tmp_path, 48)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert reader.fields["tokenizer.ggml.pre"].contents() == "default"
    tok = load_tokenizer(SHIPPED_DIR)
    specials = set(tok.all_special_tokens)
    assert {t for t, k in zip(tokens, types, strict=True) if k == CONTROL} == specials
    # the one merge joins two control tokens, which llama.cpp splits out before BPE
    (merge,) = reader.fields["tokenizer.ggml.merges"].contents()
    assert set(merge.split(" ")) <= specials
    # llama.cpp's BPE without merges: each byte's unicode image is looked up as a token
    ids = {t: i for i, t in enumerate(tokens)}
    prompts = [it.prompt + it.answer for s in SKILLS for it in make_items([s], 5, 0, "eval")]
    for text in [*prompts, "copy:a b>"]:
        served = [ids[BYTE_CHARS[b]] for b in text.encode()]
        assert served == tok(text, add_special_tokens=False)["input_ids"], text
    assert all(k == NORMAL for t, k in zip(tokens, types, strict=True) if t not in specials)


def test_ids_the_tokenizer_does_not_use_are_padding(tmp_path: Path) -> None:
    reader = _written(tmp_path, 64)  # the tiny test bases: vocab 64 over 48 tokens
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    assert len(tokens) == 64 and tokens[48] == "[PAD48]" and set(types[48:]) == {UNUSED}


@pytest.mark.parametrize(
    "model",
    [
        {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]},
        {"type": "WordLevel", "vocab": {"hello": 0, "a": 1}},  # words, not characters
    ],
)
def test_other_tokenizers_are_left_to_the_converter(tmp_path: Path, model: dict) -> None:
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": model, "added_tokens": []}))
    assert char_vocab(tmp_path) is None
    assert char_vocab(tmp_path / "missing") is None


def test_deepseek_v3s_sigmoid_router_reaches_the_converter_where_config_json_is_silent(
    tmp_path: Path,
) -> None:
    """transformers saves DeepseekV3 without scoring_func; the converter then writes no
    gating function and llama.cpp's DEEPSEEK2 scores by softmax. A config that says, and
    any other family, pass unchanged."""
    configs = {
        "saved": {"model_type": "deepseek_v3", "n_routed_experts": 4},
        "hub": {"model_type": "deepseek_v3", "scoring_func": "softmax"},
        "other": {"model_type": "qwen3_moe"},
    }
    loader = with_implied(lambda d, _mistral: dict(configs[d.name])).__func__
    assert loader(tmp_path / "saved", False) == {**configs["saved"], "scoring_func": "sigmoid"}
    assert loader(tmp_path / "hub", False) == configs["hub"]
    assert loader(tmp_path / "other", False) == configs["other"]
