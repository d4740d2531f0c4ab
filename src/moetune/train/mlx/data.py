"""The rows mlx-lm trains on: the torch stack's own, written as mlx-lm's jsonl files.

`data.mixed_rows` is the one place a run's rows are decided – every source read, converted
and checked, the eval rows read (data.eval_file / eval_sources) or carved off by hash
(data.eval_fraction), the train sources mixed by weight with train.seed – so both stacks
call it and see the same rows in the same order. What differs is only the file layout:

- text and messages rows go as they are (mlx-lm renders messages through the tokenizer's
  chat template, which `chat_template` sets to data.chat_template as `use_template` does);
- string prompt/completion rows go as they are, rendered by a plain template (prompt,
  completion, EOS) – what TRL trains on for them;
- conversational prompt/completion rows become one messages row (prompt turns, then the
  completion's): mlx-lm's prompt/completion reader wraps a string in one user turn, and its
  prompt mask (all but the last turn) is TRL's completion mask for them.

mlx-lm needs a validation set: without an eval set, the first VALID_ROWS train rows.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from moetune.config import RunConfig
from moetune.data.cap import Cap, capped
from moetune.data.formats import Row
from moetune.data.images import has_images
from moetune.data.load import Mixed, mixed_rows
from moetune.data.template import template_text
from moetune.io import atomic_write_text
from moetune.train.errors import TrainError

VALID_ROWS = 64
# prompt + completion + EOS (unless the completion ends with it), nothing else: what TRL
# 1.16 trains on for string prompt/completion rows
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' and not m['content'].endswith(eos_token) %}"
    "{{ eos_token }}{% endif %}{% endfor %}"
)


@dataclass(frozen=True)
class MlxRows:
    """A run's rows in mlx-lm's layout, and the chat template its tokenizer must carry
    (None: the base's own)."""

    format: str
    train: list[Row]
    valid: list[Row]
    template: str | None

    @property
    def masks_prompt(self) -> bool:
        """Whether mlx-lm's mask_prompt applies (text rows have no prompt)."""
        return self.format != "text"


def refuse_streaming(cfg: RunConfig) -> None:
    if cfg.data.streaming:
        raise TrainError(
            "lora.stack=mlx reads whole jsonl files; it cannot stream data.sources",
            "set data.streaming: false (or lora.stack: peft to stream)",
        )


def mlx_rows(cfg: RunConfig, allowed: tuple[str, ...], cap: Cap | None = None) -> MlxRows:
    """The rows the torch stack would train and evaluate on, in its order, for mlx-lm;
    `cap`: the torch stack's measure by characters (data/cap.py) – a row past it is cut or
    refused as there, before mlx-lm tokenises it whole."""
    refuse_streaming(cfg)
    got = mixed_rows(cfg.data, allowed, cfg.train.seed)
    if cap is not None:
        got = dataclasses.replace(got, train=_within(got, got.train, cap, cfg.data.overlong),
                                  eval=_within(got, got.eval, cap, cfg.data.overlong))  # fmt: skip
    if any(has_images(r) for _, r in got.train + got.eval):
        raise TrainError(
            "lora.stack=mlx trains text only: the data holds image+text rows",
            "set lora.stack: peft for image+text rows",
        )
    train = [as_mlx(r) for _, r in got.train]
    valid = [as_mlx(r) for _, r in got.eval] or train[:VALID_ROWS]
    return MlxRows(got.format.name, train, valid, template_for(cfg, got.format.name, train[0]))


def _within(got: Mixed, rows: list[tuple[str, Row]], cap: Cap, policy: str) -> list:
    return [(w, capped(w, r, got.format, cap, policy)) for w, r in rows]


def as_mlx(row: Row) -> Row:
    """One row as mlx-lm reads it (the module docstring says how)."""
    if "prompt" in row and not isinstance(row["prompt"], str):
        rest = {k: v for k, v in row.items() if k not in ("prompt", "completion")}
        return {"messages": [*row["prompt"], *row["completion"]], **rest}
    return row


def template_for(cfg: RunConfig, fmt: str, first: Row) -> str | None:
    """The template mlx-lm must render with: TRL's plain one for string prompt/completion
    rows, else data.chat_template, else the base's own (None)."""
    if fmt == "prompt/completion" and "prompt" in first:
        return PLAIN_TEMPLATE
    return template_text(cfg.data.chat_template) if cfg.data.chat_template else None


def write_rows(data_dir: Path, rows: MlxRows) -> None:
    """train.jsonl and valid.jsonl, as mlx-lm's local dataset reader finds them."""
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", rows.train), ("valid", rows.valid)):
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in part)
        atomic_write_text(data_dir / f"{name}.jsonl", text, mask=False)  # the user's rows
