"""llama.cpp's convert_hf_to_gguf.py with the vocabulary of a character-level tokenizer.

Run by export/gguf.py as `python gguf_vocab.py LLAMA_CPP_DIR MODEL_DIR OUTFILE` (not
imported by moetune's package code). The stock converter reads a BPE tokenizer's
pre-tokenizer by hashing how it splits a test string and refuses any hash it does not
know – the demo base's WordLevel-over-characters tokenizer among them. For such a
tokenizer this writes the vocabulary itself, in llama.cpp's byte-level BPE form: every
character a token (a space as GPT-2's `Ġ`, the byte-to-unicode map llama.cpp decodes),
the special tokens as CONTROL, the `default` pre-tokenizer (a split into words does not
change a character-by-character encoding) and one merge between two control tokens, which
llama.cpp requires and never applies (control tokens are split out before BPE). Every
other tokenizer, and every tensor, goes through the converter unchanged.

It also fills in hparams a transformers class implies but the config.json it saves leaves
out (IMPLIED), where the converter would otherwise let llama.cpp fall back to another default.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

CONTROL, NORMAL, UNUSED = 3, 1, 5  # gguf.TokenType values (fixed by the GGUF format)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-unicode map: printable bytes stay, the others (space, control
    bytes) take U+0100 onwards in byte order – what llama.cpp's BPE vocabulary holds."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    rest = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


BYTE_CHARS = _bytes_to_unicode()


def byte_level(text: str) -> str:
    """`text` as a byte-level BPE token (a space is `Ġ`)."""
    return "".join(BYTE_CHARS[b] for b in text.encode())


def char_vocab(model_dir: Path) -> dict[str, Any] | None:
    """The WordLevel vocabulary of single characters in tokenizer.json, with its added
    (special) tokens; None for any other tokenizer (the converter's own path then)."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    added = {t["content"]: t["id"] for t in doc.get("added_tokens", [])}
    model = doc.get("model", {})
    vocab: dict[str, int] = model.get("vocab", {})
    if model.get("type") != "WordLevel" or not vocab:
        return None
    if any(len(tok) != 1 for tok in vocab if tok not in added):
        return None
    return {"vocab": vocab, "special": added}


def gguf_vocab(found: dict[str, Any], vocab_size: int) -> tuple[list[str], list[int]]:
    """Tokens (byte-level) and token types for ids 0..vocab_size-1; ids the tokenizer does
    not use are `[PADi]`, UNUSED, as the converter writes them."""
    by_id = {i: tok for tok, i in found["vocab"].items()}
    tokens, types = [], []
    for i in range(vocab_size):
        tok = by_id.get(i)
        if tok is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif tok in found["special"]:
            tokens.append(tok)
            types.append(CONTROL)
        else:
            tokens.append(byte_level(tok))
            types.append(NORMAL)
    return tokens, types


def inert_merge(found: dict[str, Any]) -> str:
    """A merge of two control tokens: llama.cpp needs merges, and this one never applies."""
    first, second = sorted(found["special"], key=found["special"].get)[:2]
    return f"{first} {second}"


def write_vocab(writer: Any, found: dict[str, Any], vocab_size: int, special: Any) -> None:
    """The vocabulary keys on a GGUFWriter (`special`: gguf.SpecialVocab for bos/eos/pad)."""
    tokens, types = gguf_vocab(found, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([inert_merge(found)])
    special.add_to_gguf(writer)


# model_type -> hparams its transformers class always uses. DeepseekV3 routes by sigmoid, but
# transformers' config.json carries no scoring_func (the hub's does): without it the
# converter writes no expert_gating_func and llama.cpp's DEEPSEEK2 scores by softmax.
IMPLIED: dict[str, dict[str, Any]] = {"deepseek_v3": {"scoring_func": "sigmoid"}}


def with_implied(load: Any) -> Any:
    """The converter's hparams loader, with IMPLIED filled in where config.json is silent."""

    def loader(dir_model: Path, is_mistral_format: bool) -> dict[str, Any]:
        config = load(dir_model, is_mistral_format)
        return {**IMPLIED.get(config.get("model_type", ""), {}), **config}

    return staticmethod(loader)


def main() -> None:
    root, model, outfile = sys.argv[1:4]
    sys.path.insert(0, root)  # the converter's modules live in the llama.cpp dir only
    converter = importlib.import_module("convert_hf_to_gguf")  # puts its gguf-py on the path
    model_base = importlib.import_module("conversion.base").ModelBase
    model_base.load_hparams = with_implied(model_base.load_hparams)
    text_model = importlib.import_module("conversion.base").TextModel
    # lazy: heavy to import (gguf: the converter's own gguf-py, found only from here on)
    import gguf

    stock = text_model._set_vocab_gpt2

    def set_vocab(self: Any) -> None:
        found = char_vocab(Path(self.dir_model))
        if found is None:
            stock(self)
            return
        special = gguf.SpecialVocab(self.dir_model, load_merges=False)
        write_vocab(self.gguf_writer, found, int(self.hparams["vocab_size"]), special)

    text_model._set_vocab_gpt2 = set_vocab
    sys.argv = ["convert_hf_to_gguf.py", model, "--outfile", outfile, "--outtype", "f32"]
    converter.main()


if __name__ == "__main__":
    main()
