"""Chat templates and the loss masks they give.

The tokenizer's own template renders messages (`apply_chat_template`); data.chat_template
overrides it with a .jinja file or a template TRL ships, by name. Assistant-only loss:
a template with `{% generation %}` markers says which tokens are the assistant's itself;
one without them is rendered prefix by prefix instead – the conversation up to an assistant
turn (with the generation prompt) and up to its end – and the characters between are the
turn's, mapped onto tokens by their offsets. A template that renders earlier turns
differently once later ones follow cannot be masked that way, and says so.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetune.data.errors import DataError
from moetune.data.images import text_turns
from moetune.errors import clip, os_problem

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Turns = list[dict[str, Any]]
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
# what check_template renders: one exchange, as plain strings and as content blocks, with
# the special tokens tokenizers pass (a template may print them)
PROBES: list[Turns] = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    [{"role": r, "content": [{"type": "text", "text": t}]} for r, t in (("user", "hi"),
                                                                        ("assistant", "hello"))],
]  # fmt: skip
SPECIAL: dict[str, Any] = {
    "bos_token": "<s>",
    "eos_token": "</s>",
    "pad_token": "<pad>",
    "unk_token": "<unk>",
}


def shipped_templates() -> dict[str, Path]:
    """The chat templates TRL ships (trl/chat_templates/*.jinja), by name; found without
    importing TRL."""
    spec = importlib.util.find_spec("trl")
    if spec is None or spec.origin is None:
        return {}
    folder = Path(spec.origin).parent / "chat_templates"
    return {p.stem: p for p in sorted(folder.glob("*.jinja"))}


def template_text(choice: str) -> str:
    """data.chat_template as template text: a file's, or a shipped template's."""
    path = Path(choice).expanduser()
    named = shipped_templates()
    if not path.is_file():
        path = named.get(choice, path)
    if not path.is_file():
        some = ", ".join(difflib.get_close_matches(choice, named, 4, 0.4) or list(named)[:6])
        raise DataError(
            f"data.chat_template {choice!r} is neither a file nor a template TRL ships",
            f"give a .jinja file's path or a name such as {some} ({len(named)} in all)",
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = os_problem(exc) if isinstance(exc, OSError) else "it is not UTF-8 text"
        raise DataError(
            f"data.chat_template {clip(path, 100)}: {why}",
            "give a .jinja text file, or a template TRL ships by name",
        ) from None
    if not text.strip():  # it would render every conversation as nothing
        raise DataError(
            f"data.chat_template {choice!r}: the template is empty",
            f"write the template into {path}, or name one TRL ships ({template_choices()})",
        )
    return text


FAMILIAR = ("qwen3", "deepseekv3", "glm4moe", "gptoss", "llama3", "gemma3")  # named first


def template_choices() -> str:
    """A few of the templates TRL ships, by name, and how many there are."""
    named = shipped_templates()
    some = [n for n in FAMILIAR if n in named] or list(named)[:6]
    return f"{', '.join(some)}, … {len(named)} in all" if named else "none installed"


def check_template(choice: str | None) -> None:
    """data.chat_template read, compiled and rendered on a plain user → assistant exchange
    (every chat template must render one), before any model or tokenizer is loaded."""
    if not choice:
        return
    # lazy: heavy to import (transformers)
    from transformers.utils.chat_template_utils import render_jinja_template

    text, failed = template_text(choice), []
    for probe in PROBES:  # string turns, or content blocks (image+text templates want them)
        try:
            render_jinja_template([probe], chat_template=text, **SPECIAL)
            return
        except Exception as exc:  # the template is the user's code: whatever it raises is theirs
            failed.append(exc)
    first = failed[0]
    raise DataError(
        f"data.chat_template {clip(choice, 80)} cannot render a user → assistant exchange "
        f"({type(first).__name__}: {clip(first, 100)})",
        "fix the template (jinja2 syntax, no raise_exception on plain turns), or unset it",
    )


def applied(tok: PreTrainedTokenizerBase, turns: Turns, **kw: Any) -> Any:
    """apply_chat_template, where a template that raises on a row is the row's DataError."""
    # lazy: heavy to import (jinja2, through transformers)
    from jinja2 import TemplateError

    try:
        return tok.apply_chat_template(turns, **kw)
    except TemplateError as exc:
        raise DataError(
            f"the chat template refuses this conversation ({clip(exc, 100)})",
            "fix the row, or set data.chat_template to one that renders it",
        ) from None


def use_template(tok: PreTrainedTokenizerBase, choice: str | None) -> None:
    """Set data.chat_template on the tokenizer (it is saved with the adapter)."""
    if choice:
        tok.chat_template = template_text(choice)


def has_markers(tok: PreTrainedTokenizerBase) -> bool:
    template = tok.chat_template if isinstance(tok.chat_template, str) else ""
    return bool(_GENERATION_TAG.search(template))


def render(tok: PreTrainedTokenizerBase, turns: Turns, prompt: bool = False) -> str:
    if not turns:
        return ""
    return str(applied(tok, turns, tokenize=False, add_generation_prompt=prompt))


def assistant_spans(tok: PreTrainedTokenizerBase, turns: Turns) -> tuple[str, list[range]]:
    """The rendered conversation and the character span of each assistant turn."""
    full, spans = render(tok, turns), []
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        before, upto = render(tok, turns[:i], prompt=True), render(tok, turns[: i + 1])
        if not (full.startswith(upto) and upto.startswith(before)):
            raise DataError(
                f"the chat template renders turn {i + 1} differently once later turns follow, "
                "so its assistant tokens cannot be found by rendering prefixes",
                "use a template with {% generation %} markers (data.chat_template), or set "
                "data.completion_only_loss: false",
            )
        spans.append(range(len(before), len(upto)))
    return full, spans


def _by_offsets(tok: PreTrainedTokenizerBase, text: str, spans: list[range]) -> tuple[list, list]:
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    inside = [any(s in span for span in spans) for s, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), [int(x) for x in inside]


def masked_ids(tok: PreTrainedTokenizerBase, turns: Turns) -> tuple[list[int], list[int]]:
    """(input_ids, 1 where the token is an assistant turn's) of a conversation (the text of
    image+text turns: their image tokens are the processor's, train/vision.py)."""
    turns = text_turns(turns)
    if has_markers(tok):
        out: Any = applied(
            tok, turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(out["input_ids"]), list(out["assistant_masks"])
    if not tok.is_fast:
        raise DataError(
            "assistant-only loss without {% generation %} markers needs a fast tokenizer "
            "(token offsets)",
            "use a template with generation markers, or set data.completion_only_loss: false",
        )
    return _by_offsets(tok, *assistant_spans(tok, turns))


def text_masked_ids(
    tok: PreTrainedTokenizerBase, prompt: str, completion: str
) -> tuple[list[int], list[int]]:
    """(input_ids, 1 on the completion's tokens) of a plain prompt/completion row."""
    return _by_offsets(tok, prompt + completion, [range(len(prompt), len(prompt + completion))])
