"""Rules on where the model's code comes from: a checkpoint that ships its own."""

from __future__ import annotations

from pathlib import Path

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
