"""Rows measured by characters before anything tokenises them whole.

One 30 MB completion, tokenised whole (offsets included), took more than 12 GB. No token
decodes to more characters than the longest entry of the vocabulary (byte-level and
byte-fallback entries spell a byte with one character or more), so a sequence of more than
`seq_len × longest` characters is certainly longer than train.seq_len tokens. The cap is
twice that: a row past it is cut to the cap (data.overlong: truncate – what lies beyond
could never reach the model, and the first seq_len tokens are unchanged) or refused with its
source and index (data.overlong: error), before a tokenizer sees it.

Every string a chat template may render counts: a turn's content and text, and its tool
calls' names and arguments too (a 3 MB `arguments` string was tokenised whole before). A cut
shortens text in reading order but keeps the strings that name things whole (roles, types,
names, image paths: not counted toward the cap), and a row whose kept strings alone pass the
cap is refused, never tokenised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moetune.data.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from moetune.data.formats import DataFormat, Row

KEPT_KEYS = frozenset({"role", "type", "name", "id", "image", "path", "url"})  # never cut
MARGIN = 2  # the cap over the least characters that certainly exceed seq_len tokens


@dataclass(frozen=True)
class Cap:
    """The characters a sequence of a row may hold before it is tokenised."""

    chars: int
    seq_len: int
    longest: int  # characters of the vocabulary's longest entry


def char_cap(tok: PreTrainedTokenizerBase, seq_len: int) -> Cap:
    longest = max((len(t) for t in tok.get_vocab()), default=1)
    return Cap(MARGIN * seq_len * longest, seq_len, longest)


def chars(value: Any, kept: bool = False) -> int:
    """Characters of the text in a row's value – a string, or turns / blocks / tool calls of
    them at any depth (a template may render any of them) – leaving out what a cut keeps
    whole (KEPT_KEYS); `kept`: the characters of just those."""
    if isinstance(value, str):
        return 0 if kept else len(value)
    if isinstance(value, list):
        return sum(chars(v, kept) for v in value)
    if isinstance(value, dict):
        return sum(len(v) if kept and k in KEPT_KEYS and isinstance(v, str)
                   else 0 if k in KEPT_KEYS else chars(v, kept)
                   for k, v in value.items())  # fmt: skip
    return 0


def _cut(value: Any, budget: int) -> tuple[Any, int]:
    """(`value` with its text cut to `budget` characters in reading order, characters kept)."""
    if isinstance(value, str):
        return value[:budget], min(len(value), budget)
    if isinstance(value, list):
        out, used = [], 0
        for item in value:
            new, n = _cut(item, budget - used)
            out.append(new)
            used += n
        return out, used
    if isinstance(value, dict):
        new_dict, used = dict(value), 0
        for key, item in value.items():
            if key in KEPT_KEYS:  # a role or a path cut short would change what the row is
                continue
            new_dict[key], n = _cut(item, budget - used)
            used += n
        return new_dict, used
    return value, 0


def row_chars(row: Row, fmt: DataFormat) -> int:
    """The characters of the row's longest sequence (preference rows hold two)."""
    return max(sum(chars(row[k]) for k in seq) for seq in fmt.token_sequences())


def _cut_row(row: Row, fmt: DataFormat, cap: int) -> Row:
    out = dict(row)
    for seq in fmt.token_sequences():  # a key shared by two sequences is cut alike in both
        left = cap
        for key in seq:
            out[key], used = _cut(row[key], left)
            left -= used
    return out


def capped(where: str, row: Row, fmt: DataFormat, cap: Cap, policy: str) -> Row:
    """The row within the cap: as it is, cut (truncate) or refused (error), never tokenised;
    `where` names its source and its place in it."""
    kept = max(sum(chars(row[k], kept=True) for k in seq) for seq in fmt.token_sequences())
    if kept > cap.chars:  # roles, names, paths: never cut, so a row of them is refused
        raise DataError(
            f"{where}: {kept:,} characters in what a cut keeps whole (roles, names, paths), "
            f"certainly longer than train.seq_len={cap.seq_len} tokens; not tokenised",
            "shorten the row's names and paths, or raise train.seq_len",
        )
    n = row_chars(row, fmt)
    if n <= cap.chars:
        return row
    if policy == "error":
        raise DataError(
            f"{where}: {n:,} characters, certainly longer than train.seq_len="
            f"{cap.seq_len} tokens (a token spells at most {cap.longest}); not tokenised",
            "shorten the row, raise train.seq_len, or set data.overlong=truncate",
        )
    return _cut_row(row, fmt, cap.chars)
