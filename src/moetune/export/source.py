"""Resolve what `moetune export` was given: a run dir (config.yaml + adapter/) or an adapter
dir (adapter_config.json), and the base model it was trained on."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from moetune.config import load_config
from moetune.data.files import read_rows
from moetune.errors import MoetuneError, clip
from moetune.export.registry import ExportError, Source
from moetune.io import PROMOTED, PROMOTION_FIX, digest_matches, promotion_broken
from moetune.model.finite import require_adapter_config
from moetune.model.remote import prepare as prepare_remote
from moetune.model.sources import resolve_config
from moetune.model.weight_files import check_weight_files
from moetune.train.errors import DataError
from moetune.train.rundir.recovery import checkpoint_problem


def resolve_source(path: Path, base: str | None = None, trust_remote_code: bool = False) -> Source:
    """The adapter and base behind `path`; `base` overrides the one the run or adapter names.
    A run trained with model.trust_remote_code exports with it."""
    if (path / "config.yaml").is_file() and (path / "adapter").is_dir():
        return _promotion_intact(_from_run(path, base, trust_remote_code))
    if (path / "adapter_config.json").is_file():
        named = _need_base(base or _adapter_config(path).get("base_model_name_or_path"), path)
        source = Source(adapter_dir=path, base=named, trust_remote_code=trust_remote_code)
        return _promotion_intact(source)
    raise ExportError(
        f"{clip(path, 80)} is neither a run dir (config.yaml + adapter/) nor a peft adapter",
        "pass the run's output.dir or its adapter/ folder (with adapter_config.json)",
    )


def _promotion_intact(source: Source) -> Source:
    """`source`, unless its adapter's PROMOTED marker vouches for other bytes: an export
    must never ship a swapped adapter as the promoted one."""
    if why := promotion_broken(source.adapter_dir):
        raise ExportError(why, PROMOTION_FIX)
    return source


UNPROMOTED_FIX = (
    "promote it first (`moetune gate RESULTS --promote`, on a GO), or pass --unpromoted to "
    "export it anyway (the export and the report say so)"
)


def unpromoted(source: Source) -> str | None:
    """Why the adapter must not ship as a fine-tune that passed: it was evaluated (its run's
    verdict.json names these exact bytes) and carries no PROMOTED marker; None when it is
    promoted, or no eval of these bytes is known (an adapter without its run)."""
    run_dir = source.run_dir or source.adapter_dir.parent
    if (source.adapter_dir / PROMOTED).is_file() or not (run_dir / "config.yaml").is_file():
        return None
    try:
        cfg = load_config(run_dir / "config.yaml")
        verdict_file = cfg.eval.results_path(str(run_dir)) / "verdict.json"
        verdict = json.loads(verdict_file.read_text(encoding="utf-8"))
        evaluated = digest_matches(source.adapter_dir, verdict["adapter_sha256"])
    except (MoetuneError, OSError, ValueError, KeyError, TypeError):
        return None  # no readable verdict: never evaluated as far as the run shows
    if not evaluated:
        return None
    return (
        f"the adapter in {clip(source.adapter_dir, 80)} was evaluated ({verdict.get('verdict')}: "
        f"{clip(verdict.get('reason', ''), 100)}) and never promoted"
    )


def require_promoted(source: Source, allow: bool) -> str | None:
    """Refuse an evaluated, unpromoted adapter unless `allow` (--unpromoted); the note the
    export and the report then carry."""
    why = unpromoted(source)
    if why and not allow:
        raise ExportError(why, UNPROMOTED_FIX)
    return f"exported with --unpromoted: {why}" if why else None


def _from_run(run_dir: Path, base: str | None, trust: bool) -> Source:
    cfg = load_config(run_dir / "config.yaml")
    trust = trust or cfg.model.trust_remote_code
    return Source(run_dir / "adapter", base or cfg.model.id, run_dir, trust, cfg.model.tokenizer)


def require_buildable(source: Source) -> None:
    """A local base whose modeling code ships with it is registered (trusted) or refused in
    one line naming its files and the flag – never transformers' interactive prompt."""
    if not (source.trust_remote_code or Path(source.base).is_dir()):
        return
    name, config = resolve_config(source.base)
    prepare_remote(name, config, source.trust_remote_code)


def _adapter_config(adapter_dir: Path) -> dict[str, Any]:
    require_adapter_config(adapter_dir)  # an empty one is not "names no base"
    try:
        return dict(json.loads((adapter_dir / "adapter_config.json").read_text()))
    except (OSError, ValueError) as err:
        raise ExportError(
            f"cannot read {clip(adapter_dir, 60)}/adapter_config.json: {clip(err, 80)}",
            "point at a folder written by peft's save_pretrained",
        ) from None


def _need_base(base: str | None, adapter_dir: Path) -> str:
    if not base:
        raise ExportError(
            f"{clip(adapter_dir, 80)} does not name its base model",
            "pass --base DIR_OR_HUB_ID (the model the adapter was trained on)",
        )
    return base


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.pt", "*.pth")


def require_whole_adapter(adapter_dir: Path) -> None:
    """Refuse an adapter whose files are missing, dangling links, truncated or not what
    their names say – before anything is built or written."""
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        path = adapter_dir / name
        if path.is_symlink() and not path.exists():
            raise ExportError(
                f"{clip(path, 80)} is a link to nowhere ({clip(os.readlink(path), 60)})",
                "point the link at the adapter file, or re-save the adapter",
            )
        if not path.is_file():
            raise ExportError(
                f"{clip(adapter_dir, 80)} has no {name}",
                "pass a folder written by peft's save_pretrained (a run's adapter/)",
            )
    try:
        problem = checkpoint_problem(adapter_dir)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        problem = f"unreadable ({type(err).__name__})"
    if problem:
        raise ExportError(
            f"the adapter in {clip(adapter_dir, 80)} is damaged: {problem}",
            "export from an intact copy (re-save or re-bank the adapter)",
        )


def require_weights(base: str) -> list[str]:
    """A local base dir must hold weights, not only config.json, and whole ones (the merge
    and the check read its tensors); a note naming each stray weight file beside them."""
    folder = Path(base).expanduser()
    local = base.startswith(("/", ".", "~")) or base.count("/") != 1  # not owner/name
    if local and not folder.exists():  # else the hub client's repo-id check says it, exit 3
        raise ExportError(
            f"the base {clip(base, 80)} does not exist",
            "pass --base the model dir the adapter was trained on (or a hub id owner/name)",
        )
    if folder.is_dir() and not any(any(folder.glob(p)) for p in WEIGHT_FILES):
        raise ExportError(
            f"the base {clip(base, 80)} has a config.json but no weights (*.safetensors)",
            "pass --base the full checkpoint the adapter was trained on",
        )
    return check_weight_files(folder)  # a damaged one: one line, before the out dir is made


def item_texts(path: Path, limit: int) -> list[str]:
    """The prompts of an `--items` file: rows with a "prompt" (any answer / completion
    beside it is ignored) or a "text"; the first row with neither is refused, named."""
    fix = (
        'give --items a JSONL file of {"prompt": ...} (an answer may follow) or {"text": ...} rows'
    )
    try:
        rows = read_rows(path)
    except DataError as err:
        raise ExportError(f"--items: {err.cause}", fix) from None
    texts = []
    for where, row in rows[:limit]:
        text = (row.get("prompt") or row.get("text")) if isinstance(row, dict) else None
        if not isinstance(text, str) or not text:
            raise ExportError(f"--items {clip(path, 60)} {where}: no prompt or text", fix)
        texts.append(text)
    return texts
