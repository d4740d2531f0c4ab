"""What `moetune data` shows before anything trains: rows per source and after mixing, the
token-length histogram against train.seq_len (rows it truncates, rows it leaves with no
loss token at all), the share of tokens that carry loss, rendered samples with their loss
mask, rows the eval set shares with the training set, and the step count.

The masks are the ones training uses (template.py); each format says how its rows are
tokenised (`MASKS`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from moetune.data.errors import DataError
from moetune.data.formats import FORMATS, Row, _chat_ids
from moetune.data.images import image_counts
from moetune.data.load import CHECK_ROWS, Checked, Mixed, mixed_rows, no_streamed_images, usable
from moetune.data.mix import row_key
from moetune.data.template import masked_ids, render, text_masked_ids, use_template

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from moetune.config import RunConfig

Masked = tuple[list[int], list[int]]  # (input_ids, 1 where the token carries loss)
SAMPLES = 3
BINS = 8  # histogram bins up to train.seq_len, then one for the rows beyond it


def _chat_completion(tok: PreTrainedTokenizerBase, prompt: list, completion: list) -> Masked:
    before, full = render(tok, prompt, prompt=True), render(tok, prompt + completion)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(s >= len(before)) for s, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def _completion(tok: PreTrainedTokenizerBase, prompt: Any, completion: Any) -> Masked:
    if isinstance(prompt, str):
        ids, mask = text_masked_ids(tok, prompt, completion)
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        return ids + eos, mask + [1] * len(eos)
    return _chat_completion(tok, prompt, completion)


def _text(row: Row, tok: PreTrainedTokenizerBase) -> Masked:
    ids = list(tok(row["text"], add_special_tokens=False)["input_ids"])
    return ids, [1] * len(ids)


def _prompt(row: Row, tok: PreTrainedTokenizerBase) -> Masked:
    ids, _ = _completion(tok, row["prompt"], "" if isinstance(row["prompt"], str) else [])
    return ids, [0] * len(ids)  # GRPO: the loss is on sampled completions


MASKS: dict[str, Callable[[Row, PreTrainedTokenizerBase], Masked]] = {
    "messages": lambda r, t: masked_ids(t, r["messages"]),
    "prompt/completion": lambda r, t: _completion(t, r["prompt"], r["completion"]),
    "text": _text,
    "preference": lambda r, t: _completion(t, r["prompt"], r["chosen"]),  # the chosen side
    "prompt": _prompt,
}


def _every_token(fmt: str) -> Callable[[Row, PreTrainedTokenizerBase], Masked]:
    def masks(row: Row, tok: PreTrainedTokenizerBase) -> Masked:
        ids = _chat_ids(tok, row["messages"]) if fmt == "messages" else MASKS[fmt](row, tok)[0]
        return ids, [1] * len(ids)

    return masks


@dataclass(frozen=True)
class Summary:
    sources: list[dict[str, Any]]
    format: str
    rows: int  # after mixing
    eval_rows: int
    seq_len: int
    histogram: list[dict[str, Any]]  # {"upto": tokens or None (beyond seq_len), "rows": n}
    truncated: int  # rows longer than seq_len
    no_loss_left: int  # rows whose loss tokens all lie beyond seq_len (they teach nothing)
    loss_share: float  # of the tokens within seq_len
    duplicates: int  # eval rows that also appear in the training rows
    steps: int | None
    samples: list[list[tuple[str, bool]]]  # rendered: (text, carries loss) runs
    streaming_rows_checked: int | None = None
    images: dict[str, Any] | None = None  # image+text rows: images per row (images.py)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def refuse_no_loss(self) -> None:
        """No token of any row carries loss (after the template's masks and the cut at
        train.seq_len): every step's loss would be 0 and the adapter would learn nothing."""
        if self.rows and self.loss_share == 0 and not FORMATS[self.format].sampled:
            read = "the first " if self.streaming_rows_checked else ""  # a head, when streamed
            raise DataError(
                f"no token of {read}{self.rows} training rows carries loss after the chat "
                f"template's masks and the cut at train.seq_len={self.seq_len}: the run "
                "would learn nothing",
                "look at the samples `moetune data` renders (loss in green): raise "
                "train.seq_len, shorten the prompts, or mark the assistant turns in the "
                "template ({% generation %})",
            )

    def one_line(self) -> str:
        """The summary `moetune train` prints before the first step."""
        mix = " + ".join(f"{s['rows']} {s['source']}" for s in self.sources)
        steps = f" · ~{self.steps} steps" if self.steps else ""
        steps += f" · {self.images['images']} images" if self.images else ""
        return (
            f"data: {mix} → {self.rows} rows ({self.format}), {self.eval_rows} eval · "
            f"{self.loss_share:.0%} of tokens carry loss · {self.truncated} over seq_len "
            f"{self.seq_len} ({self.no_loss_left} left with no loss) · {self.duplicates} eval "
            f"rows also in train{steps}"
        )


def _histogram(lengths: list[int], seq_len: int) -> list[dict[str, Any]]:
    width = max(1, math.ceil(seq_len / BINS))
    edges = [min(seq_len, width * (n + 1)) for n in range(BINS)]
    counts = [0] * (len(edges) + 1)
    for n in lengths:
        counts[next((i for i, e in enumerate(edges) if n <= e), len(edges))] += 1
    return [{"upto": e, "rows": c} for e, c in zip([*edges, None], counts, strict=True)]


def segments(tok: PreTrainedTokenizerBase, ids: list[int], mask: list[int]) -> list[Any]:
    """The tokens decoded, in runs of the same mask value."""
    runs: list[tuple[str, bool]] = []
    for token, bit in zip(ids, mask, strict=True):
        text = str(tok.decode([token]))
        if runs and runs[-1][1] == bool(bit):
            runs[-1] = (runs[-1][0] + text, bool(bit))
        else:
            runs.append((text, bool(bit)))
    return runs


def _steps(cfg: RunConfig, rows: int) -> int | None:
    t = cfg.train
    if t.max_steps:
        return t.max_steps
    per_step = t.batch_size * t.grad_accum * t.nproc * t.nnodes
    return math.ceil(math.ceil(rows / per_step) * t.epochs) if rows else None


def summarize(
    cfg: RunConfig, tok: PreTrainedTokenizerBase, allowed: tuple[str, ...],
    checked: Checked | None = None,
) -> Summary:  # fmt: skip
    """The data summary of a run config (the rows mixed exactly as training mixes them;
    `checked`: check_sources' result when the rows were already read)."""
    use_template(tok, cfg.data.chat_template)
    if checked is not None and not cfg.data.streaming:
        return _summary_of(cfg, tok, mixed_rows(cfg.data, allowed, cfg.train.seed, checked))
    data = cfg.data.model_copy(update={"streaming": False}) if cfg.data.streaming else cfg.data
    if cfg.data.streaming:  # only a head of each source: the set may not fit in RAM
        sources = [  # a smaller max_rows of the user's is kept
            s.model_copy(update={"max_rows": min(s.max_rows or CHECK_ROWS, CHECK_ROWS)})
            for s in data.train_sources()
        ]
        data = data.model_copy(update={"sources": sources, "train_file": None})
    got = mixed_rows(data, allowed, cfg.train.seed)
    if cfg.data.streaming:
        no_streamed_images(got.label, got.train)
    return _summary_of(cfg, tok, got)


def _checked(cfg: RunConfig, tok: PreTrainedTokenizerBase, got: Mixed) -> Mixed:
    """The rows as training takes them: the same tokenizer checks (load.usable), the same cut."""
    seq_len, policy, only = cfg.train.seq_len, cfg.data.overlong, cfg.data.completion_only_loss
    train, _ = usable(got.label, got.format, got.train, tok, seq_len, policy, only)
    held = (
        usable(got.eval_label, got.format, got.eval, tok, seq_len, policy, only)[0]
        if got.eval
        else []
    )
    return dataclasses.replace(got, train=train, eval=held)


def _summary_of(cfg: RunConfig, tok: PreTrainedTokenizerBase, got: Mixed) -> Summary:
    got = _checked(cfg, tok, got)
    seq_len, masks = cfg.train.seq_len, MASKS[got.format.name]
    if not cfg.data.completion_only_loss:  # every token; no template masking needed
        masks = _every_token(got.format.name)
    masked = [masks(row, tok) for _, row in got.train]
    lengths = [len(ids) for ids, _ in masked]
    kept = [m[:seq_len] for _, m in masked]
    carried = sum(sum(m) for m in kept)
    train_keys = {row_key(r) for _, r in got.train}
    return Summary(
        sources=[{"source": p.label, "rows": len(p.rows), "weight": p.weight} for p in got.parts],
        format=got.format.name,
        rows=len(got.train),
        eval_rows=len(got.eval),
        seq_len=seq_len,
        histogram=_histogram(lengths, seq_len),
        truncated=sum(n > seq_len for n in lengths),
        no_loss_left=sum(any(m) and not any(k) for (_, m), k in zip(masked, kept, strict=True)),
        loss_share=carried / max(1, sum(len(k) for k in kept)),
        duplicates=sum(row_key(r) in train_keys for _, r in got.eval),
        steps=_steps(cfg, len(got.train)),
        samples=[segments(tok, ids, m) for ids, m in masked[:SAMPLES]],
        streaming_rows_checked=CHECK_ROWS if cfg.data.streaming else None,
        images=image_counts([r for _, r in got.train]),
    )
