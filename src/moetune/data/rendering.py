"""How a run's rows became text, recorded at train time (data.json "rendering") so the eval
renders its prompts the same way: through the chat template that trained the adapter
(messages rows, or prompt/completion rows whose prompt is a message list), or as written
(text rows, string prompt/completion rows). One rendering path: the template itself is
applied by template.render, as for training.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from moetune.data.errors import DataError
from moetune.data.template import render

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PROBE = "\x00moetune-answer\x00"  # an assistant reply no template prints on its own


def template_sha256(tok: PreTrainedTokenizerBase) -> str | None:
    template = tok.chat_template if isinstance(tok.chat_template, str) else None
    return hashlib.sha256(template.encode()).hexdigest() if template else None


@dataclass(frozen=True)
class Rendering:
    """A run's row rendering: its data format, whether rows went through the chat template,
    where that template came from and its sha256 (the eval refuses another)."""

    format: str | None  # messages | prompt/completion | text; None: not recorded
    chat: bool
    template: str | None = None  # data.chat_template, or "the tokenizer of <model>"
    template_sha256: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of_run(
        cls, fmt: str, first: dict[str, Any], tok: PreTrainedTokenizerBase, source: str
    ) -> Rendering:
        """What training did with rows of `fmt` (`first`: a row as read, before tokenising)."""
        chat = fmt == "messages" or not isinstance(first.get("prompt", ""), str)
        if not chat:
            return cls(fmt, False)
        return cls(fmt, True, source, template_sha256(tok))

    @classmethod
    def from_json(cls, doc: Any) -> Rendering:
        if not isinstance(doc, dict) or not isinstance(doc.get("chat"), bool):
            raise DataError(
                "data.json's rendering record is damaged",
                "re-run `moetune train` (data.json is written by it, never by hand)",
            )
        return cls(doc.get("format"), doc["chat"], doc.get("template"), doc.get("template_sha256"))

    def check_tokenizer(self, tok: PreTrainedTokenizerBase) -> None:
        """The eval's tokenizer must carry the template the run trained with."""
        if self.chat and template_sha256(tok) != self.template_sha256:
            raise DataError(
                f"the chat template differs from the one the run trained with ({self.template})",
                "evaluate with the run's data.chat_template and model (the template is part "
                "of what was trained), or train again with this one",
            )

    def prompt_ids(self, tok: PreTrainedTokenizerBase, prompt: str) -> list[int]:
        """The tokens a model sees before its answer: the prompt as a user turn with the
        generation prompt (chat), or the text with the tokenizer's special tokens."""
        if not self.chat:
            return list(tok(prompt, add_special_tokens=True)["input_ids"])
        text = render(tok, [{"role": "user", "content": prompt}], prompt=True)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def turn_end(self, tok: PreTrainedTokenizerBase) -> str:
        """What the template prints after an assistant reply ("<|im_end|>"): where a
        generated answer ends (empty for raw rows: EOS ends it)."""
        if not self.chat:
            return ""
        turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": PROBE}]
        full = render(tok, turns)
        return full[full.index(PROBE) + len(PROBE) :].strip() if PROBE in full else ""


def template_source(chat_template: str | None, model_id: str) -> str:
    """Where a run's chat template comes from, in words (data.json and its errors)."""
    return (
        f"data.chat_template {chat_template}" if chat_template else f"the tokenizer of {model_id}"
    )


RAW = Rendering(None, False)  # prompts scored as written (no record of the run's format)
