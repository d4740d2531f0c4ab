"""The data a run trains on: every source read, converted and checked (the first row sets
a source's format; all sources must share one), the eval rows carved or read, the sources
mixed by weight with the run's seed, and the rows handed to TRL as a `datasets` dataset –
tokenised here, with moetune's assistant masks, when the chat template has no generation
markers. Nothing is trained or written before all of it has passed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from moetune.config import SourceArgs
from moetune.data.cap import Cap, capped, char_cap
from moetune.data.convert import BECOMES, auto_format, converted
from moetune.data.errors import DataError, TokenizerError
from moetune.data.formats import (
    SFT_FORMATS,
    DataFormat,
    Loss,
    Row,
    _uses_chat,
    check_row,
    prompt_fills,
)
from moetune.data.formats import detect_format as _detect
from moetune.data.images import as_blocks, has_images, image_counts, with_images
from moetune.data.mix import held_out, interleave, mix, row_key, weighted_count
from moetune.data.sources import Located, label, read_source, stream_source
from moetune.data.template import check_template, masked_ids, template_choices, use_template

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from moetune.config import DataArgs

Overlong = Literal["truncate", "error"]
CHECK_ROWS = 256  # data.streaming: rows of each source checked before training starts


@dataclass(frozen=True)
class SourceRows:
    """One source, read and checked: its TRL format and rows, where each came from."""

    label: str
    format: DataFormat
    rows: list[tuple[str, Row]]
    weight: float = 1.0


def _convert(lab: str, src: SourceArgs, located: list[Located]) -> list[Located]:
    fmt = src.format if src.format != "auto" else auto_format(located[0][1])
    out = []
    for where, row in located:
        new = converted(row, fmt, src.columns)
        if isinstance(new, str):
            raise DataError(f"{lab} {where}: {new}", "fix that row, or set format: / columns:")
        out.append((where, new))
    return out


def _allowed(lab: str, src: SourceArgs, first: Any, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """The formats this source may hold: the method's, narrowed by its format: setting."""
    fmt = src.format if src.format != "auto" else auto_format(first)
    if fmt not in BECOMES:
        return allowed
    if BECOMES[fmt] not in allowed:
        raise DataError(
            f"source {lab}: {src.format} rows are {BECOMES[fmt]} rows, not for this train.method",
            f"give this method {' | '.join(allowed)} rows",
        )
    return (BECOMES[fmt],)


def check_source(
    src: SourceArgs, allowed: tuple[str, ...], located: list[Located] | None = None
) -> SourceRows:
    """A source's rows converted and checked (no tokenizer: a bad row fails in ms)."""
    lab = label(src)
    raw = read_source(src) if located is None else located
    rows = _convert(lab, src, raw)
    fmt = _detect(lab, *rows[0], _allowed(lab, src, raw[0][1], allowed))
    first = rows[0][1]
    checked = [(w, _imaged(lab, w, check_row(lab, w, r, fmt, first), src)) for w, r in rows]
    return SourceRows(lab, fmt, checked, src.weight)


def _imaged(lab: str, where: str, row: Row, src: SourceArgs) -> Row:
    """A row with images: placed, resolved against the data file's folder and decoded."""
    if not has_images(row):
        return row
    if "messages" not in row:
        raise DataError(f"{lab} {where}: images go with messages rows",
                        "write image+text rows as messages (docs/data.md)")  # fmt: skip
    path = Path(src.path).expanduser()
    return with_images(lab, where, row, path if path.is_dir() else path.parent)


def read_checked(
    path: Path, allowed: tuple[str, ...] = SFT_FORMATS
) -> tuple[DataFormat, list[tuple[str, Row]]]:
    """One file's rows, read and checked against the format its first row sets."""
    got = check_source(SourceArgs.model_validate({"path": str(path)}), allowed)
    return got.format, got.rows


def _one_format(parts: list[SourceRows]) -> DataFormat:
    for part in parts[1:]:
        if part.format.name != parts[0].format.name:
            raise DataError(
                f"source {part.label} holds {part.format.name} rows but {parts[0].label} "
                f"{parts[0].format.name}",
                "give every source (and the eval set) the same row format",
            )
    return parts[0].format


@dataclass(frozen=True)
class TrainData:
    """Checked rows of one or more sources, as a `datasets` dataset, with what the loss is
    taken on. `path` names the sources (errors and data.json)."""

    path: str
    format: str
    dataset: Any  # datasets.Dataset, or an IterableDataset with data.streaming
    loss: Loss
    overlong: int  # rows longer than the sequence length (TRL truncates them)
    sha256: str  # of the rows in training order: the same for a resume and on every rank
    sources: list[dict[str, Any]] = field(default_factory=list)  # label, rows read, weight
    streamed: bool = False
    images: dict[str, Any] | None = None  # image_counts of image+text rows (images.py)

    @property
    def rows(self) -> int:
        return sum(s["rows"] for s in self.sources) if self.streamed else len(self.dataset)

    def head(self, limit: int = CHECK_ROWS) -> list[Row]:
        """The first `limit` rows as training reads them (a streamed set has no length)."""
        if self.streamed:
            return list(islice(self.dataset, limit))
        return list(self.dataset.select(range(min(limit, len(self.dataset)))).to_list())

    def columns(self) -> list[str]:
        """The rows' columns (a streamed set names none: its first row's keys)."""
        if self.dataset.column_names is not None:
            return list(self.dataset.column_names)
        return list(self.head(1)[0]) if self.head(1) else []

    def column(self, name: str) -> list[Any]:
        """A column's values: every row's, or a streamed set's first CHECK_ROWS rows'."""
        return [r[name] for r in self.head()] if self.streamed else list(self.dataset[name])

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.path,
            "format": self.format,
            "rows": self.rows,
            "streaming": self.streamed,
            "sources": self.sources,
            "loss_on": self.loss.on,
            "overlong_rows_truncated": self.overlong,
            "sha256": self.sha256,
            **({"images": self.images} if self.images else {}),
        }


def needs_template(lab: str, fmt: DataFormat, first: Row, tok: PreTrainedTokenizerBase) -> None:
    """Rows with message lists need a chat template (lint, `data` and `train` ask this)."""
    if _uses_chat(first) and not tok.chat_template:
        raise TokenizerError(
            f"{lab}: {fmt.name} rows with message lists need a chat template; "
            "the tokenizer has none",
            f"set data.chat_template to a .jinja file or a template TRL ships "
            f"({template_choices()}), or use prompt/completion or text rows",
        )


def usable(
    lab: str, fmt: DataFormat, rows: list[tuple[str, Row]], tok: PreTrainedTokenizerBase,
    seq_len: int, policy: str, completion_only: bool = True,
) -> tuple[list[tuple[str, Row]], int]:  # fmt: skip
    """The checks a tokenizer settles, one function for `moetune train` and `moetune data`:
    message rows need a chat template; each row is measured by characters before it is
    tokenised (cut or refused past the cap, cap.py); rows over train.seq_len are counted
    or refused (data.overlong). (The rows within the cap, the count over seq_len.) `rows`
    are located: (the source and where in it, the row)."""
    needs_template(lab, fmt, rows[0][1], tok)
    cap = char_cap(tok, seq_len)
    rows = [(w, capped(w, r, fmt, cap, policy)) for w, r in rows]
    too_long = _count_overlong(rows, fmt, tok, seq_len, policy)
    if completion_only and too_long == len(rows):
        _not_all_starved(lab, fmt, rows, tok, seq_len)
    return rows, too_long


def _not_all_starved(
    lab: str, fmt: DataFormat, rows: list[tuple[str, Row]], tok: Any, seq_len: int
) -> None:
    """Every row over seq_len and every prompt filling it: truncation leaves no completion
    token anywhere, TRL drops every row and the trainer dies on an empty dataset."""
    if all(prompt_fills(r, fmt, tok, seq_len) for _, r in rows):
        raise DataError(
            f"{lab}: every row's prompt fills train.seq_len={seq_len}, so no completion "
            "token is left to learn from",
            "raise train.seq_len above the prompts' token length (see `moetune data`)",
        )


def _count_overlong(
    rows: list[tuple[str, Row]], fmt: DataFormat, tok: Any, seq_len: int, policy: str
) -> int:
    count = 0
    for where, row in rows:
        length = _length(where, row, fmt, tok)
        if length <= seq_len:
            continue
        if policy == "error":
            raise DataError(
                f"{where}: {length} tokens, longer than train.seq_len={seq_len}",
                "shorten the row, raise train.seq_len, or set data.overlong=truncate",
            )
        count += 1
    return count


def _length(where: str, row: Row, fmt: DataFormat, tok: PreTrainedTokenizerBase) -> int:
    """The row's tokens; a chat template that cannot render it (a syntax error, its own
    raise_exception) is the row's error, in one line, not a crash."""
    try:
        return fmt.length(row, tok)
    except DataError as err:  # template.applied's, named by the row
        raise DataError(f"{where}: {err.cause}", err.fix) from None


def tokenised(where: str, row: Row, tok: PreTrainedTokenizerBase) -> Row:
    """A messages row as TRL's tokenised input: ids and the assistant tokens' mask; `where`
    names its source and place in it."""
    try:
        ids, mask = masked_ids(tok, row["messages"])
    except DataError as err:
        raise DataError(f"{where}: {err.cause}", err.fix) from None
    return {"input_ids": ids, "assistant_masks": mask}


def _build(
    lab: str, fmt: DataFormat, rows: list[tuple[str, Row]], tok: Any, seq_len: int,
    data: DataArgs, sources: list[dict[str, Any]],
) -> TrainData:  # fmt: skip
    # lazy: heavy to import (datasets)
    from datasets import Dataset

    rows, too_long = usable(lab, fmt, rows, tok, seq_len, data.overlong, data.completion_only_loss)
    images = image_counts([r for _, r in rows])
    if images:  # the processor tokenises them, image tokens and masks (train/vision.py)
        loss, table = image_loss(data.completion_only_loss), [vision_row(r) for _, r in rows]
    else:
        loss = fmt.loss(data.completion_only_loss, tok)
        table = [tokenised(w, r, tok) if loss.prerender else r for w, r in rows]
    sha = row_key([r for _, r in rows])
    dataset = Dataset.from_list(table)
    return TrainData(lab, fmt.name, dataset, loss, too_long, sha, sources, images=images)


def image_loss(completion_only: bool) -> Loss:
    """Image+text rows: moetune's collator masks the assistant turns (TRL's needs generation
    markers in the processor's template); the rows reach it untokenised."""
    on = "assistant turns (masked by rendering prefixes through the processor)"
    return Loss({}, on if completion_only else "all tokens (data.completion_only_loss off)")


def vision_row(row: Row) -> Row:
    """A row as TRL's vision path passes it to the collator: turns as JSON text (one arrow
    type whether a content is a string or blocks) and the images' paths."""
    return {"messages": json.dumps(as_blocks(row["messages"])), "images": row.get("images") or []}


def _summary(parts: list[SourceRows]) -> list[dict[str, Any]]:
    return [{"source": p.label, "rows": len(p.rows), "weight": p.weight} for p in parts]


def _split(parts: list[SourceRows], fraction: float) -> tuple[list[SourceRows], list[Any]]:
    """(the sources without their held-out rows, the held-out rows): a row's hash decides."""
    if not fraction:
        return parts, []
    kept = [SourceRows(p.label, p.format, [x for x in p.rows if not held_out(x[1], fraction)],
                       p.weight) for p in parts]  # fmt: skip
    carved = [x for p in parts for x in located(p) if held_out(x[1], fraction)]
    if not carved or any(not p.rows for p in kept):
        raise DataError(
            f"data.eval_fraction={fraction} leaves an empty train or eval set",
            "change data.eval_fraction, or name an eval source (data.eval_file / eval_sources)",
        )
    return kept, carved


def located(part: SourceRows) -> list[tuple[str, Row]]:
    """The rows, each named by its source and its place in it (mixed rows keep their source)."""
    return [(f"{part.label} {where}", row) for where, row in part.rows]


def _mixed(parts: list[SourceRows], seed: int) -> list[tuple[str, Row]]:
    return mix([(located(p), p.weight) for p in parts], seed)


Checked = tuple[list[SourceRows], list[SourceRows]]  # (train sources, eval sources)


def check_sources(data: DataArgs, allowed: tuple[str, ...] = SFT_FORMATS) -> Checked:
    """Every row of every source read and checked, without a tokenizer or a model: a bad row
    stops a run in milliseconds (data.streaming: the first CHECK_ROWS of each)."""
    if not data.train_sources():
        raise DataError(
            "data.train_file is not set: nothing to train on",
            "set data.train_file or data.sources (or --set data.train_file=train.jsonl)",
        )
    check_template(data.chat_template)
    if data.streaming:
        heads = [(s, list(islice(stream_source(s), CHECK_ROWS))) for s in data.train_sources()]
        return [check_source(s, allowed, head) for s, head in heads], []
    parts = [check_source(s, allowed) for s in data.train_sources()]
    held = [check_source(s, allowed) for s in data.held_out_sources()]
    _one_format(parts + held)
    _every_source_yields(parts + held)
    return parts, held


def _every_source_yields(parts: list[SourceRows]) -> None:
    """A weight below 1 keeps a share of a source's rows: a share of none is a typo."""
    for part in parts:
        if not weighted_count(len(part.rows), part.weight):
            raise DataError(
                f"source {part.label}: weight {part.weight} keeps 0 of its {len(part.rows)} rows",
                f"raise its weight to at least {1 / len(part.rows):.3g}, or leave it out",
            )


@dataclass(frozen=True)
class Mixed:
    """The rows a run trains and evaluates on, in order, before any tokenizer sees them."""

    format: DataFormat
    parts: list[SourceRows]  # the train sources, held-out rows removed
    train: list[tuple[str, Row]]
    eval: list[tuple[str, Row]]
    eval_label: str
    eval_parts: list[dict[str, Any]]

    @property
    def label(self) -> str:
        return ", ".join(p.label for p in self.parts)


def mixed_rows(
    data: DataArgs, allowed: tuple[str, ...], seed: int, checked: Checked | None = None
) -> Mixed:
    """Sources checked, the eval rows read or carved, the train sources mixed by weight."""
    parts, held = checked or check_sources(data, allowed)
    fmt = _one_format(parts + held)
    parts, carved = _split(parts, data.eval_fraction)
    _every_source_yields(parts)  # of the rows left once the eval share is carved off
    if held:
        label_ = ", ".join(p.label for p in held)
        return Mixed(fmt, parts, _mixed(parts, seed), _mixed(held, seed), label_, _summary(held))
    cut = [{"source": f"eval_fraction {data.eval_fraction}", "rows": len(carved)}] if carved else []
    lab = ", ".join(p.label for p in parts)
    return Mixed(fmt, parts, _mixed(parts, seed), carved, f"{lab} (held out)", cut)


def load_train_data(
    data: DataArgs, tok: PreTrainedTokenizerBase, seq_len: int,
    allowed: tuple[str, ...] = SFT_FORMATS, seed: int = 0, checked: Checked | None = None,
) -> tuple[TrainData, TrainData | None]:  # fmt: skip
    """The training set and the optional eval set of a run config; `allowed`: the formats
    the run's train.method reads; `seed`: train.seed, which orders the mix; `checked`:
    check_sources' result, when the rows were already read."""
    if not data.train_sources():
        check_sources(data, allowed)  # says what is missing
    use_template(tok, data.chat_template)
    if data.streaming:
        return load_streamed(data, tok, seq_len, allowed, seed), None
    got = mixed_rows(data, allowed, seed, checked)
    train = _build(got.label, got.format, got.train, tok, seq_len, data, _summary(got.parts))
    if not got.eval:
        return train, None
    held = _build(got.eval_label, got.format, got.eval, tok, seq_len, data, got.eval_parts)
    return train, held


# ---------------------------------------------------------------- data.streaming


def _stream_rows(src: SourceArgs, allowed: tuple[str, ...], fraction: float) -> Iterator[Row]:
    """A source's rows, converted and checked as they are read, held-out ones left out."""
    lab, head = label(src), list(islice(stream_source(src), 1))
    if not head:
        raise DataError(f"source {lab} is empty: no rows to train on", "add rows to it")
    fmt = check_source(src, allowed, head).format
    for where, row in stream_source(src):
        rows = _convert(lab, src, [(where, row)])
        checked = check_row(lab, where, rows[0][1], fmt, head[0][1] if fmt.extras else None)
        if not held_out(checked, fraction):
            yield checked


def load_streamed(
    data: DataArgs, tok: PreTrainedTokenizerBase, seq_len: int, allowed: tuple[str, ...], seed: int
) -> TrainData:
    """data.streaming: an IterableDataset over the weighted interleave of the sources; the
    first CHECK_ROWS rows of each are checked now, the rest as training reads them."""
    # lazy: heavy to import (datasets)
    from datasets import IterableDataset

    sources = data.train_sources()
    heads = [check_source(s, allowed, list(islice(stream_source(s), CHECK_ROWS))) for s in sources]
    fmt = _one_format(heads)
    lab = ", ".join(h.label for h in heads)
    for head in heads:  # the same checks as `moetune data` runs on these rows
        no_streamed_images(head.label, head.rows)
        usable(head.label, fmt, located(head), tok, seq_len, data.overlong)
    loss, cap = fmt.loss(data.completion_only_loss, tok), char_cap(tok, seq_len)

    def rows() -> Iterator[Row]:
        streams = [_stream_rows(s, allowed, data.eval_fraction) for s in sources]
        for n, row in enumerate(interleave(streams, [s.weight for s in sources], seed), 1):
            yield _streamed_row(f"{lab} mixed row {n}", row, fmt, cap, data.overlong, tok, loss)

    sha = row_key([[label(s), s.weight, seed] for s in sources])  # what the stream is made of
    summary = _summary(heads)
    return TrainData(lab, fmt.name, IterableDataset.from_generator(rows), loss, 0, sha,
                     summary, streamed=True)  # fmt: skip


def _streamed_row(
    where: str, row: Row, fmt: DataFormat, cap: Cap, policy: str,
    tok: PreTrainedTokenizerBase, loss: Loss,
) -> Row:  # fmt: skip
    """A streamed row as training reads it: within the cap, tokenised where moetune masks."""
    row = capped(where, row, fmt, cap, policy)
    return tokenised(where, row, tok) if loss.prerender else row


def no_streamed_images(lab: str, rows: list[tuple[str, Row]]) -> None:
    """Image+text rows are read whole (their images decoded): data.streaming refuses them."""
    if image_counts([r for _, r in rows]):
        raise DataError(f"{lab}: image+text rows are not streamed",
                        "set data.streaming: false for image rows")  # fmt: skip
