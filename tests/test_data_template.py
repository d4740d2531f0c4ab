"""Chat templates and the masks they give, token by token: the tokenizer's own template,
data.chat_template (a file, a template TRL ships), generation markers where the template
has them and rendered prefixes where it has not – system turns, several turns, tool calls."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

import moetune.train.trainer as trainer_mod
from moetune.cli import app
from moetune.data.errors import DataError
from moetune.data.template import (
    check_template,
    has_markers,
    masked_ids,
    shipped_templates,
    use_template,
)
from moetune.demo.base import SHIPPED_DIR as DEMO_BASE
from moetune.demo.tokenizer import build_tokenizer
from test_train_helpers import GEN_TEMPLATE, one_thread, run_config, save_tiny_model, write_jsonl

PLAIN = (  # no generation markers: role letter, ':', content, then '>' or <eos> after a reply
    "{% for m in messages %}{{ m['role'][0] }}:"
    "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}"
    "{{ c['function']['name'] }}={{ c['function']['arguments']['x'] }}{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}"
    "{% if m['role'] == 'assistant' %}<eos>{% else %}>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
CHAT = [
    {"role": "system", "content": "be"},
    {"role": "user", "content": "ab"},
    {"role": "assistant", "content": "ba"},
    {"role": "user", "content": "cd"},
    {"role": "assistant", "content": "dc"},
]


def _tok(template: str):
    tok = build_tokenizer()
    tok.chat_template = template
    return tok


def _marked(tok, ids: list[int], mask: list[int]) -> str:
    """The conversation with its loss tokens in [brackets]."""
    out, inside = "", False
    for token, bit in zip(ids, mask, strict=True):
        if bit != inside:
            out, inside = out + ("[" if bit else "]"), bool(bit)
        out += tok.convert_ids_to_tokens(token)
    return out + ("]" if inside else "")


def test_prefix_masks_cover_each_reply_and_its_end_token_only():
    tok = _tok(PLAIN)
    assert not has_markers(tok)
    ids, mask = masked_ids(tok, CHAT)
    assert _marked(tok, ids, mask) == "s:be>u:ab>a:[ba<eos>]u:cd>a:[dc<eos>]"
    assert (
        ids
        == tok(tok.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False)["input_ids"]
    )


def test_prefix_masks_equal_the_generation_markers_masks():
    chat = CHAT[1:]
    marked = masked_ids(_tok(GEN_TEMPLATE), chat)
    stripped = GEN_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert has_markers(_tok(GEN_TEMPLATE)) and not has_markers(_tok(stripped))
    assert masked_ids(_tok(stripped), chat) == marked
    assert sum(marked[1]) == 6  # "ba<eos>" and "dc<eos>"


def test_a_tool_call_turn_trains_and_the_tool_output_does_not():
    tok = _tok(PLAIN)
    call = {"type": "function", "function": {"name": "rev", "arguments": {"x": "ab"}}}
    chat = [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "ba"},
        {"role": "assistant", "content": "ba"},
    ]
    ids, mask = masked_ids(tok, chat)
    assert _marked(tok, ids, mask) == "u:ab>a:[rev=ab<eos>]t:ba>a:[ba<eos>]"


def test_a_template_that_rewrites_earlier_turns_is_refused():
    last = "{% if loop.last %}z{% endif %}"
    tok = _tok("{% for m in messages %}" + last + "{{ m['content'] }}{% endfor %}")
    with pytest.raises(DataError, match="renders turn 2 differently") as info:
        masked_ids(tok, CHAT[1:3])
    assert "generation" in info.value.fix


def test_data_chat_template_a_file_or_a_template_trl_ships(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(PLAIN, encoding="utf-8")
    tok = build_tokenizer()
    use_template(tok, str(path))
    assert tok.chat_template == PLAIN
    shipped = shipped_templates()
    assert {"qwen3", "qwen3_training", "llama3"} <= set(shipped)
    use_template(tok, "qwen3_training")
    assert tok.chat_template == shipped["qwen3_training"].read_text(encoding="utf-8")
    assert has_markers(tok)
    text = tok.apply_chat_template(CHAT[1:3], tokenize=False)
    assert "<|im_start|>assistant" in text
    with pytest.raises(DataError, match="neither a file nor a template") as info:
        use_template(tok, "qwen-3")
    assert "qwen3" in info.value.fix  # the nearest names


def test_training_takes_the_prefix_masks_as_its_labels(tmp_path, monkeypatch):
    """Untagged template: TRL gets moetune's tokenised rows; its labels are the masks."""
    seen = {}
    real_fit = trainer_mod.fit

    def spy(trainer, setup, console):
        seen["rows"] = list(trainer.train_dataset)
        seen["line"] = setup.data_summary.one_line()
        real_fit(trainer, setup, console)

    monkeypatch.setattr(trainer_mod, "fit", spy)
    model = save_tiny_model(tmp_path / "m", chat_template=PLAIN)
    rows = [{"messages": CHAT}, {"messages": CHAT[1:3]}] * 2
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = run_config(model, data, tmp_path / "out", max_steps=1, save_steps=50, routing_every=0)
    with one_thread():
        trainer_mod.train(cfg, progress=False)
    tok = _tok(PLAIN)
    for row in seen["rows"]:
        assert len(row["labels"]) == len(row["input_ids"])
        ids, mask = masked_ids(tok, CHAT if len(row["input_ids"]) > 20 else CHAT[1:3])
        assert row["input_ids"] == ids[:32]
        assert [lab != -100 for lab in row["labels"]] == [bool(b) for b in mask[:32]]
    assert "4 rows (messages)" in seen["line"] and "carry loss" in seen["line"]


# ---------------------------------------------------------------- issue 36 item 8: bad jinja

BAD_TEMPLATES: dict[str, str | bytes] = {
    "syntax": "{% for m in %}",
    "raising": "{{ raise_exception('this template refuses everything') }}",
    "binary": bytes(range(128, 256)) * 2,
}


@pytest.mark.parametrize("kind", list(BAD_TEMPLATES))
@pytest.mark.parametrize("rows", ["messages", "prompt_completion"])
def test_a_bad_chat_template_is_one_line_exit_2_before_any_model(tmp_path, kind, rows):
    """A chat template that does not compile, raises on a plain exchange or is not text was
    exit 3 (TemplateSyntaxError / TemplateError / UnicodeDecodeError), or silently accepted
    for prompt/completion rows; now `data` and `train` refuse it in one line, no run dir."""
    content = BAD_TEMPLATES[kind]
    template = tmp_path / "t.jinja"
    template.write_bytes(content if isinstance(content, bytes) else content.encode())
    row = (
        {"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}]}
        if rows == "messages"
        else {"prompt": "ab", "completion": "ba"}
    )
    data = write_jsonl(tmp_path / "train.jsonl", [row] * 4)
    cfg = {
        "model": {"id": str(DEMO_BASE)},
        "data": {"train_file": str(data), "chat_template": str(template)},
        "output": {"dir": str(tmp_path / "run"), "ledger": str(tmp_path / "ledger.jsonl")},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    for command in ("data", "train"):
        result = CliRunner().invoke(app, [command, str(tmp_path / "run.yaml")])
        assert result.exit_code == 2, (command, result.output)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) <= 2 and "Traceback" not in result.stderr
        assert "data.chat_template" in lines[0] and "fix:" in result.stderr
    assert not (tmp_path / "run").exists()


def test_every_template_trl_ships_passes_the_check():
    for name in shipped_templates():
        check_template(name)  # plain-string or content-block turns: each renders one


def test_a_template_raising_on_one_row_names_the_row(tmp_path):
    """A template may refuse some conversations (a role it has no place for): that row,
    named, not an exit 3."""
    tok = build_tokenizer()
    use_template(tok, None)
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system turns') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(DataError, match=r"refuses this conversation .*no system turns"):
        masked_ids(tok, CHAT)
