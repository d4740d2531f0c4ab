"""Image+text rows on a multimodal checkpoint: its own processor turns them into
pixel_values and input_ids with the image tokens, and the loss lies on the assistant turns.

The processor is the checkpoint's, loaded offline from model.id (`AutoProcessor`). Without
torchvision, transformers cannot build the video processor that Qwen3-VL's (and most)
processor classes hold, although image rows never use it; the processor class is then built
from the checkpoint's image processor (its PIL backend) and tokenizer with that slot empty,
and the run says so. A checkpoint with no loadable image processor is refused in one line;
text-only rows still train.

The rows reach TRL's SFTTrainer untokenised (its vision path: processing_class = the
processor); `ImageCollator` tokenises them row by row, so processors that cannot batch rows
with different image counts work, and masks the assistant turns by rendering prefixes –
TRL's own collator masks only through `{% generation %}` markers, which published templates
rarely have.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image

from moetune.data.errors import DataError
from moetune.data.template import render, template_text
from moetune.train.errors import TrainError

if TYPE_CHECKING:
    from moetune.config import RunConfig

IGNORE = -100  # labels the loss skips


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else type(exc).__name__


def _processor_class_name(model_id: str) -> str | None:
    """The checkpoint's processor class: its preprocessor_config.json, else its model type's."""
    # lazy: heavy to import (transformers)
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    saved = Path(model_id) / "preprocessor_config.json"
    if saved.is_file():
        name = json.loads(saved.read_text(encoding="utf-8")).get("processor_class")
        if name:
            return str(name)
    found = PROCESSOR_MAPPING_NAMES.get(AutoConfig.from_pretrained(model_id).model_type)
    return str(found) if found else None


def _image_only(cls: Any, empty: list[str]) -> type:
    """transformers' processor class, accepting an empty slot for the parts whose backend
    is not installed (video, audio): everything image rows use is the class's own.
    `built_without` names those slots (processor_source reads it)."""

    def check(self: Any, name: str, arg: Any) -> Any:
        return None if arg is None else cls.check_argument_for_proper_class(self, name, arg)

    def save_pretrained(self: Any, save_directory: str, **kwargs: Any) -> None:
        """The parts it holds (tokenizer, image processor), as the checkpoint had them."""
        for part in (self.tokenizer, self.image_processor):
            part.save_pretrained(save_directory)

    methods = {"check_argument_for_proper_class": check, "save_pretrained": save_pretrained}
    return type(cls.__name__, (cls,), {**methods, "built_without": tuple(empty)})


def _template(model_id: str, tok: Any) -> str | None:
    saved = Path(model_id) / "chat_template.jinja"
    return saved.read_text(encoding="utf-8") if saved.is_file() else tok.chat_template


def _from_parts(model_id: str) -> tuple[Any, list[str]]:
    """(the processor built from the checkpoint's image processor and tokenizer, the parts
    left empty)."""
    # lazy: heavy to import (transformers)
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    name = _processor_class_name(model_id)
    if name is None:
        raise ValueError("no processor class is known for it")
    cls = getattr(transformers, name)  # a missing backend raises ImportError here
    image, tok = (
        AutoImageProcessor.from_pretrained(model_id),
        AutoTokenizer.from_pretrained(model_id),
    )
    parts = {"image_processor": image, "tokenizer": tok}
    empty = [a for a in cls.get_attributes() if a not in parts]
    kwargs = {a: parts.get(a) for a in cls.get_attributes()}
    return _image_only(cls, empty)(**kwargs, chat_template=_template(model_id, tok)), empty


def load_processor(model_id: str, chat_template: str | None = None) -> tuple[Any, list[str]]:
    """(the checkpoint's processor, notes to say); TrainError in one line when image rows
    cannot be processed offline."""
    # lazy: heavy to import (transformers)
    from transformers import AutoProcessor, ProcessorMixin

    notes: list[str] = []
    try:
        proc = AutoProcessor.from_pretrained(model_id)
    except (ImportError, OSError, ValueError, TypeError, AttributeError, KeyError):
        proc = None  # e.g. its video processor needs torchvision: built from parts below
    if not isinstance(proc, ProcessorMixin):
        try:
            proc, empty = _from_parts(model_id)
        except (ImportError, OSError, ValueError, TypeError, AttributeError, KeyError) as exc:
            raise TrainError(
                f"image rows need {model_id}'s processor, which cannot be loaded offline "
                f"({_first_line(exc)})",
                "save the checkpoint's processor files beside it (preprocessor_config.json), "
                "install what it names, or train on text-only rows",
            ) from None
        notes.append(
            f"processor {type(proc).__name__} built without its {', '.join(empty)} "
            "(its backend, e.g. torchvision, is not installed): image rows only"
        )
    if chat_template:
        proc.chat_template = template_text(chat_template)
    _pad(proc.tokenizer)
    return proc, notes


def processor_source(proc: Any) -> dict[str, Any]:
    """Which processor the run used and how it was loaded: `AutoProcessor` (the checkpoint's
    processor whole) or `parts` (its image processor + tokenizer, torchvision missing)."""
    empty = list(getattr(proc, "built_without", ()))
    via = "parts" if hasattr(proc, "built_without") else "AutoProcessor"
    return {"class": type(proc).__name__, "via": via, "without": empty}


def processor_line(proc: Any) -> str:
    """The run log's line on the processor (the fallback's warning says why)."""
    source = processor_source(proc)
    how = {"AutoProcessor": "AutoProcessor", "parts": "built from image processor + tokenizer"}
    return f"processor {source['class']} ({how[source['via']]})"


def _pad(tok: Any) -> None:
    if tok.pad_token is None:  # batches need padding; EOS is the usual stand-in
        tok.pad_token = tok.eos_token


def _open(path: str) -> Any:
    with Image.open(path) as img:
        return img.convert("RGB")


def _images_in(turns: list[dict[str, Any]]) -> int:
    return sum(b.get("type") == "image" for t in turns for b in t["content"])


@dataclass
class ImageCollator:
    """Rows {messages: JSON turns, images: paths} into one padded batch: input_ids with the
    image tokens, the processor's pixel tensors, labels on the assistant turns."""

    processor: Any
    max_length: int
    assistant_only: bool = True

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return self.batch([self.encode(r) for r in rows])

    def _process(self, turns: list[dict[str, Any]], images: list[Any], prompt: bool) -> Any:
        text = render(self.processor, turns, prompt=prompt)
        return self.processor(
            text=[text], images=images or None, return_tensors="pt", add_special_tokens=False
        )

    def encode(self, row: dict[str, Any]) -> dict[str, torch.Tensor]:
        turns, images = json.loads(row["messages"]), [_open(p) for p in row["images"]]
        out = dict(self._process(turns, images, prompt=False))
        ids = out["input_ids"][0]
        labels = ids.clone()
        if self.assistant_only:
            labels[~self.assistant_mask(turns, images, ids)] = IGNORE
        out["labels"] = labels[None]
        return self.truncated(out, len(ids))

    def _length(self, turns: list[dict[str, Any]], images: list[Any], prompt: bool) -> Any:
        return self._process(turns, images[: _images_in(turns)], prompt)["input_ids"][0]

    def assistant_mask(
        self, turns: list[dict[str, Any]], images: list[Any], ids: torch.Tensor
    ) -> torch.Tensor:
        """True on each assistant turn's tokens: those between the conversation up to the
        turn (with the generation prompt) and up to its end, each tokenised with its images."""
        mask = torch.zeros_like(ids, dtype=torch.bool)
        for i, turn in enumerate(turns):
            if turn["role"] != "assistant":
                continue
            before = self._length(turns[:i], images, prompt=True) if i else ids[:0]
            upto = self._length(turns[: i + 1], images, prompt=False)
            if not (
                torch.equal(ids[: len(upto)], upto) and torch.equal(upto[: len(before)], before)
            ):
                raise DataError(
                    f"the processor's chat template tokenises turn {i + 1} differently once "
                    "later turns follow, so its assistant tokens cannot be found",
                    "set data.chat_template to one that renders turns independently, or "
                    "data.completion_only_loss: false",
                )
            mask[len(before) : len(upto)] = True
        return mask

    def truncated(self, out: dict[str, Any], length: int) -> dict[str, Any]:
        """At most max_length tokens, never cutting into an image's tokens (the model needs
        every one of them for its features)."""
        image_id = getattr(self.processor, "image_token_id", None)
        where = (out["input_ids"][0] == image_id).nonzero() if image_id is not None else None
        keep = max(self.max_length, int(where.max()) + 1 if where is not None and len(where) else 0)
        if length <= keep:
            return out
        return {k: v[:, :keep] if _per_token(v, length) else v for k, v in out.items()}

    def batch(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        """Per-token tensors right-padded and stacked; the rest (pixels, grids, per-image
        lists) concatenated."""
        width = max(int(r["input_ids"].shape[1]) for r in rows)
        pads = {"input_ids": self.processor.tokenizer.pad_token_id, "labels": IGNORE}
        out: dict[str, Any] = {}
        for key in dict.fromkeys(k for r in rows for k in r):  # a text row has no pixels
            present = [r[key] for r in rows if key in r]
            first = next(r for r in rows if key in r)
            if _per_token(first[key], int(first["input_ids"].shape[1])):
                out[key] = torch.cat([_right_pad(v, width, pads.get(key, 0)) for v in present])
            else:
                out[key] = _joined(present)
        return out


def _joined(values: list[Any]) -> Any:
    """Rows' per-image values in one: tensors concatenated; lists (what a processor leaves
    unconverted, e.g. UnlimitedOcr's patches per image) joined in row order."""
    if all(isinstance(v, list) for v in values):
        return [item for v in values for item in v]
    return torch.cat(values)


def _per_token(value: Any, length: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length


def _right_pad(value: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    pad = torch.full((1, width - value.shape[1], *value.shape[2:]), fill, dtype=value.dtype)
    return torch.cat([value, pad], dim=1)


def check_first_row(collator: ImageCollator, dataset: Any, label: str) -> None:
    """The first row through the collator before any model is built: a processor or
    template that cannot mask it, or a seq_len its image tokens leave no answer in (an image
    is never cut, so e.g. Gemma4's ~280 tokens an image can fill it), stops the run now."""
    try:
        batch = collator([dataset[0]])
    except DataError as err:
        raise DataError(f"{label} row 1: {err.cause}", err.fix) from None
    if collator.assistant_only and not (batch["labels"] != IGNORE).any():
        images = int(
            (batch["input_ids"] == getattr(collator.processor, "image_token_id", -1)).sum()
        )
        raise DataError(
            f"{label} row 1: train.seq_len {collator.max_length} holds no token of its answer "
            f"after its {images} image tokens, so it would train on nothing",
            "raise train.seq_len (an image's tokens are never cut), or use smaller images",
        )


def vision_kwargs(cfg: RunConfig, processor: Any) -> dict[str, Any]:
    """The SFTTrainer arguments of image+text rows (none for text rows)."""
    if processor is None:
        return {}
    collator = ImageCollator(processor, cfg.train.seq_len, cfg.data.completion_only_loss)
    return {"processing_class": processor, "data_collator": collator}
