"""The run's tokenizer, loaded in one place – model.tokenizer when set, else model.id – and
refused before any weight loads when it cannot carry the run.

Three tokenizers train on nothing, or crash late, without a word from transformers:

- a model dir with no tokenizer file at all: transformers 5 still builds a tokenizer (a
  Qwen2 one whose whole vocabulary is `<|endoftext|>`), which turns every text into no
  ids, so each row trains on one end token and the run reports a loss of 0;
- a tokenizer with more tokens than the model has embedding rows: an id past the table's
  end is an IndexError on the CPU and a device-side assert on CUDA, whenever a row first
  holds one. The other way round is normal and passes: checkpoints pad their embedding
  table (Qwen3's 151,669 tokens in 151,936 rows), so a smaller vocabulary never indexes
  out of it;
- message rows with no chat template (load.py's `needs_template`, asked here too, so
  `lint` says it before `data` and `train` reach the rows).
"""

from __future__ import annotations

from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING

from moetune.data.errors import TokenizerError
from moetune.data.formats import FORMATS
from moetune.data.load import SourceRows, check_source, needs_template
from moetune.data.sources import stream_source
from moetune.data.template import use_template
from moetune.errors import MoetuneError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from moetune.config import DataArgs, ModelArgs, RunConfig

# what a saved tokenizer writes (fast, sentencepiece, BPE, WordPiece, Mistral's tekken)
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
    "merges.txt", "vocab.txt", "spiece.model", "tekken.json",
)  # fmt: skip
PROBE_TEXT = "Hello, world: 42 tokens."  # any real tokenizer gives several ids
FIX = (
    "copy the base's tokenizer files into the model dir, or set model.tokenizer to the dir "
    "or hub id of the tokenizer it was trained with"
)


class NotOnDisk(TokenizerError):
    """A hub tokenizer not in the local cache: lint cannot tell (train loads and checks it)."""


def tokenizer_source(model: ModelArgs) -> str:
    """Where the run's tokenizer comes from: model.tokenizer, else the model itself."""
    return model.tokenizer or model.id


def _missing_files(where: str) -> bool:
    """A local dir without a single tokenizer file (a hub id is not judged here)."""
    root = Path(where).expanduser()
    return root.is_dir() and not any((root / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(
    model: ModelArgs, vocab_rows: int | None = None, local_only: bool = False
) -> PreTrainedTokenizerBase:
    """The run's tokenizer, checked against the model's `vocab_rows` (its embedding rows,
    when known); a pad token set where it has none. TokenizerError when it cannot serve."""
    # lazy: heavy to import (transformers)
    from transformers import AutoTokenizer

    where = tokenizer_source(model)
    if _missing_files(where):
        raise TokenizerError(
            f"{where} holds no tokenizer file: transformers would build an empty one-token "
            "tokenizer and train on nothing",
            FIX,
        )
    try:
        tok = AutoTokenizer.from_pretrained(where, local_files_only=local_only)
    except (OSError, ValueError) as exc:
        unknown = local_only and not Path(where).expanduser().is_dir()
        raise (NotOnDisk if unknown else TokenizerError)(
            f"cannot load a tokenizer from {where}: {str(exc).splitlines()[0]}", FIX
        ) from None
    check_vocabulary(tok, where, vocab_rows)
    if tok.pad_token is None:  # batches need padding; EOS is the usual stand-in
        tok.pad_token = tok.eos_token
    return tok


def check_vocabulary(tok: PreTrainedTokenizerBase, where: str, vocab_rows: int | None) -> None:
    """Refuse a tokenizer that turns text into nothing, or one wider than the embedding."""
    ids = tok(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    if not ids or set(ids) <= {tok.unk_token_id}:
        raise TokenizerError(
            f"the tokenizer from {where} turns text into no tokens ({len(tok)} in its "
            "vocabulary): every row would train on its special tokens alone",
            FIX,
        )
    if vocab_rows is not None and len(tok) > vocab_rows:
        raise TokenizerError(
            f"the tokenizer from {where} has {len(tok):,} tokens but the model has "
            f"{vocab_rows:,} embedding rows: an id past {vocab_rows - 1:,} fails the run "
            "when a row first holds one",
            "use the tokenizer the base was trained with (model.tokenizer), or a base whose "
            "vocab_size covers this tokenizer",
        )


def run_tokenizer(
    cfg: RunConfig, vocab_rows: int | None, head: SourceRows | None
) -> PreTrainedTokenizerBase:
    """The tokenizer a run trains with (data.chat_template applied), refused when it cannot
    carry the run's rows (`head`: the first training source, when read)."""
    tok = load_tokenizer(cfg.model, vocab_rows)
    _with_template(cfg, tok, head)
    return tok


def _with_template(cfg: RunConfig, tok: PreTrainedTokenizerBase, head: SourceRows | None) -> None:
    """data.chat_template set on `tok`; message rows without any template refused."""
    use_template(tok, cfg.data.chat_template)
    if head is not None and head.rows:
        needs_template(head.label, head.format, head.rows[0][1], tok)


def first_source(data: DataArgs) -> SourceRows | None:
    """The first training source's first row as the run reads it (converted, checked), or
    None when it cannot be read here (the data checks say why)."""
    sources = data.train_sources()
    try:
        head = list(islice(stream_source(sources[0]), 1)) if sources else []
        return check_source(sources[0], tuple(FORMATS), head) if head else None
    except (MoetuneError, OSError, ValueError):
        return None


def tokenizer_problem(cfg: RunConfig, vocab_rows: int | None) -> TokenizerError | None:
    """What `data` and `train` would refuse in the run's tokenizer, found without the
    network (lint): None when it serves, or when it is a hub tokenizer not cached here."""
    try:  # the data is read only once the tokenizer is known to be here
        tok = load_tokenizer(cfg.model, vocab_rows, local_only=True)
        _with_template(cfg, tok, first_source(cfg.data))
    except NotOnDisk:
        return None
    except TokenizerError as err:
        return err
    except MoetuneError:  # a bad data.chat_template: the data checks say it
        return None
    return None
