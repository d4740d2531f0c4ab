"""Rules on the model itself: a checkpoint that ships its own code, a tokenizer that cannot
carry the run, a sequence longer than the model's positions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moetune.data.tokenizer import tokenizer_problem
from moetune.errors import MoetuneError
from moetune.lint.probes import model as probes
from moetune.lint.registry import Hit, LintContext, register_rule
from moetune.model.remote import code_files, needs_remote_code
from moetune.model.sources import resolve_config


def _shipped_code(model_id: str) -> list[str]:
    """The Python files a remote-code checkpoint would run (beside config.json when local);
    [] for a checkpoint transformers ships, or one whose config.json cannot be read here."""
    try:
        _, raw = resolve_config(model_id)
    except MoetuneError:
        return []
    if not needs_remote_code(raw):
        return []
    root = Path(model_id).expanduser()
    files = code_files(raw)
    return [str(root / f) for f in files] if root.is_dir() else files


@register_rule(
    "REMOTE-CODE",
    "warn",
    "the checkpoint's own modeling code runs with your rights",
    probe=probes.remote_code_runs,
    libraries=("transformers",),
)
def remote_code(ctx: LintContext) -> Hit | None:
    model = ctx.config.model
    files = _shipped_code(model.id) if model.trust_remote_code else []
    if not files:
        return None
    return Hit(
        f"model.trust_remote_code runs {', '.join(files)} as Python with your user's rights "
        "when the model is built (the file can read your files and tokens or reach the "
        "network), here and on every pod the lane starts",
        "read those files before the run (from a hub id: pin a revision you reviewed); "
        "a model_type transformers ships needs no remote code",
        "model.trust_remote_code",
    )


@register_rule(
    "TOKENIZER",
    "error",
    "a tokenizer that cannot carry the run trains on nothing, or fails mid-run",
    probe=probes.empty_tokenizer_built,
    libraries=("transformers",),
    enforced=True,  # train refuses it where it loads the tokenizer, in `data`'s line
)
def tokenizer(ctx: LintContext) -> Hit | None:
    """data/tokenizer.py's refusal, as `data` and `train` say it (a hub tokenizer not
    cached here is left to them: lint never reaches the network)."""
    if ctx.spec is None:
        return None
    problem = tokenizer_problem(ctx.config, ctx.spec.vocab_size)
    return None if problem is None else Hit(problem.cause, problem.fix, "model.tokenizer")


def positions(hf_config: dict[str, Any]) -> int | None:
    """The positions the model was trained on: max_position_embeddings, or a RoPE scaling's
    factor × original_max_position_embeddings when that says more (yarn, linear...)."""
    text = hf_config.get("text_config") or hf_config
    limit = text.get("max_position_embeddings") or hf_config.get("max_position_embeddings")
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    factor = rope.get("factor") if rope.get("rope_type", rope.get("type")) != "default" else None
    original = rope.get("original_max_position_embeddings") or limit
    if factor and original:
        return max(limit or 0, int(factor * original))
    return int(limit) if limit else None


@register_rule(
    "SEQ-PAST-POSITIONS",
    "error",
    "train.seq_len longer than the positions the model was trained on",
    probe=probes.positions_unchecked,
    libraries=("transformers",),
)
def seq_past_positions(ctx: LintContext) -> Hit | None:
    limit = positions(ctx.spec.hf_config) if ctx.spec is not None else None
    seq = ctx.config.train.seq_len
    if limit is None or seq <= limit:
        return None
    return Hit(
        f"train.seq_len {seq} is longer than the {limit} positions {ctx.config.model.id} was "
        "trained on (max_position_embeddings): nothing stops the run, and it trains on "
        "positions the model has never seen",
        f"set train.seq_len to at most {limit} (or a base with a longer context)",
        "train.seq_len",
    )
