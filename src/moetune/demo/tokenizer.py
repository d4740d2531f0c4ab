"""Character-level tokenizer for the demo skills.

Built with `tokenizers` (WordLevel over single characters) and wrapped in transformers'
`PreTrainedTokenizerFast`, so TRL's SFTTrainer, peft and `save_pretrained` treat it like
any hub tokenizer. Special tokens are matched before the character split, so the text
`"abc<eos>"` encodes to four ids.
"""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIALS = (PAD, EOS, BOS, UNK)  # fixed order: pad=0, eos=1, bos=2, unk=3
# Skill prompts use lowercase letters, digits and a little punctuation; a few spare
# symbols leave room for new skills without changing the vocabulary of the base.
CHARS = string.ascii_lowercase + string.digits + ":>?=,-_ "


def vocabulary() -> dict[str, int]:
    """Token -> id, specials first; stable across versions (the shipped base depends on it)."""
    tokens = [*SPECIALS, *CHARS]
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh character tokenizer; no BOS is added, TRL appends EOS to completions."""
    core = Tokenizer(models.WordLevel(vocab=vocabulary(), unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()  # join characters without the default spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        unk_token=UNK,
        model_max_length=64,
        clean_up_tokenization_spaces=False,
    )
    return tok


def save_tokenizer(tok: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    tok.save_pretrained(str(out_dir))


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a saved character tokenizer from a local directory (never the network)."""
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if not isinstance(tok, PreTrainedTokenizerFast):  # pragma: no cover - defensive
        raise TypeError(f"expected a fast tokenizer in {path}, got {type(tok).__name__}")
    return tok
