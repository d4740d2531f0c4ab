"""`moetune push RUN --repo user/name`: the run's adapter (or one of its checked exports)
to the Hugging Face Hub with a generated model card (report/card.py), in one commit.

Only what moetune vouched for goes up: the adapter must carry a PROMOTED marker that still
matches its bytes (`moetune gate --promote` writes it on GO), and an export must have
passed its served == trained check; `--unpromoted` pushes anyway, and the card says so.
The upload is huggingface_hub's own (`HfApi.create_repo`, private unless asked otherwise,
then `create_commit`); its token is whatever huggingface_hub finds (HF_TOKEN, or
`hf auth login`), never read, printed or recorded here. Every attempt is a `push` ledger row.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetune.errors import MoetuneError, clip
from moetune.io import PROMOTED, masked, promotion_broken
from moetune.ledger import DEFAULT_PATH, attempt
from moetune.report.card import HUB_ID, hub_base, model_card
from moetune.report.html import Inputs, load_inputs
from moetune.report.inputs import lookup, read_json

# never uploaded: moetune's own markers, and the README the card replaces
LEFT_OUT = frozenset({PROMOTED, "UNCHECKED", "README.md"})


class PushError(MoetuneError):
    """The run cannot be pushed as asked (not promoted, no such export, the Hub refused)."""


@dataclass(frozen=True)
class PushOptions:
    """What `moetune push` was asked for (the CLI's flags)."""

    repo: str  # user/name on the Hub
    export: str | None = None  # a format in RUN_DIR/exports.json to push instead of the adapter
    private: bool = True
    unpromoted: bool = False  # push what moetune has not vouched for (the card says so)
    base_model: str | None = None  # the base's Hub id, when model.id is a local dir
    license: str | None = None
    results_dir: Path | None = None  # eval results (default: as `moetune report`)
    ledger: Path | None = None


def push(run_dir: Path | str, opts: PushOptions) -> dict[str, Any]:
    """Upload and return what went up: repo, url, commit, files, the card (a `push` ledger
    row either way: a refusal is a failed row with its cause)."""
    if opts.results_dir is not None and not Path(opts.results_dir).is_dir():
        raise PushError(
            f"--results {clip(opts.results_dir, 100)} is not a directory",
            "pass the results dir `moetune eval` wrote (default RUN_DIR/eval)",
        )
    inp = load_inputs(Path(run_dir), opts.results_dir)
    ledger = opts.ledger or Path(str(lookup(inp.config, "output.ledger") or DEFAULT_PATH))
    with attempt(ledger, "push", run_id=inp.run_dir.resolve().name) as row:
        doc = _push(inp, opts)
        row["metrics"] = {k: doc[k] for k in ("repo", "commit", "private", "what", "bytes",
                                              "vouched")}  # fmt: skip
    return doc


def _push(inp: Inputs, opts: PushOptions) -> dict[str, Any]:
    check_ids(opts)
    folder, what = source(inp, opts.export)
    refusal = vouch(inp, folder, opts.export)
    if refusal and not opts.unpromoted:
        raise PushError(refusal, "promote it first (moetune eval, then moetune gate --promote), "
                                 "or pass --unpromoted to push it anyway")  # fmt: skip
    base = hub_base(inp, opts.base_model)
    card = model_card(inp, opts.repo, what, base, opts.license)
    files = upload_files(folder)
    url, commit = upload(opts, folder, files, card)
    return {"repo": opts.repo, "url": url, "commit": commit, "private": opts.private,
            "what": what, "folder": str(folder), "files": [*files, "README.md"],
            "bytes": sum((folder / f).stat().st_size for f in files) + len(card.encode()),
            "vouched": refusal is None, "refusal": refusal, "base_model": base,
            "card": card}  # fmt: skip


# the Hub's license ids: lower case, digits, '.', '-', '+' (apache-2.0, cc-by-nc-4.0, openrail++)
LICENSE_ID = re.compile(r"^[a-z0-9][a-z0-9.+-]{0,63}$")


def check_ids(opts: PushOptions) -> None:
    """The names that go into the upload and its card, checked before anything is sent: a
    repo id or a base the Hub refuses after `create_repo` leaves an empty repo behind."""
    for flag, repo in (("--repo", opts.repo), ("--base-model", opts.base_model)):
        if repo is not None and (why := _not_repo_id(repo, flag == "--repo")):
            raise PushError(f"{flag} {clip(masked(repo), 80)} is not a Hub repo id ({why})",
                            "pass it as user/name (or org/name)")  # fmt: skip
    if opts.license is not None and not LICENSE_ID.match(opts.license):
        raise PushError(f"--license {clip(masked(opts.license), 60)} is not a Hub license id",
                        "pass one such as apache-2.0, mit or other (lower case)")  # fmt: skip


def _not_repo_id(repo: str, namespaced: bool) -> str | None:
    """Why `repo` is no Hub id (None: it is one), by huggingface_hub's own rule; a repo to
    create needs its user/ (a base may be a legacy id without one, as gpt2)."""
    # lazy: heavy to import (huggingface_hub)
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if namespaced and not HUB_ID.match(repo):
        return "not user/name"
    try:
        validate_repo_id(repo)
    except HFValidationError:
        return "letters, digits, '-', '_', '.', no '--' or '..', at most 96 characters"
    return None


def source(inp: Inputs, export: str | None) -> tuple[Path, str]:
    """(the folder to upload, what it is): the run's adapter, or the export of `export`."""
    if export is None:
        adapter = inp.run_dir / "adapter"
        if not (adapter / "adapter_config.json").is_file():
            raise PushError(f"{clip(adapter, 100)} holds no trained adapter",
                            "push a run that finished `moetune train`")  # fmt: skip
        return adapter, "adapter"
    exports, _ = read_json(inp.run_dir / "exports.json")
    entry = (exports or {}).get(export)
    if not isinstance(entry, dict) or not Path(str(entry.get("out"))).is_dir():
        known = ", ".join(sorted(exports or {})) or "none"
        raise PushError(
            f"{clip(inp.run_dir, 80)} has no {export} export on disk (exports: {known})",
            f"run moetune export {clip(inp.run_dir, 80)} --format {export} --out DIR first",
        )
    return Path(str(entry["out"])), export


def vouch(inp: Inputs, folder: Path, export: str | None) -> str | None:
    """Why moetune does not vouch for this upload (None: promoted, and checked if an export)."""
    adapter = inp.run_dir / "adapter"
    if not (adapter / PROMOTED).is_file():
        verdict = inp.get("verdict.json").get("verdict")
        said = f"the gate said {verdict}" if verdict else "it was never gated"
        return f"the adapter of {clip(inp.run_dir.name, 60)} is not promoted ({said})"
    if broken := promotion_broken(adapter):
        return broken
    verdict, marker = inp.get("verdict.json"), inp.get(PROMOTED)
    if verdict and verdict.get("hash") != marker.get("verdict_hash") and verdict["verdict"] != "GO":
        return f"a later gate said {verdict['verdict']} for the promoted adapter"
    if export is None:
        return None
    check = ((read_json(inp.run_dir / "exports.json")[0] or {}).get(export) or {}).get("check")
    if (folder / "UNCHECKED").is_file() or not (check or {}).get("passed"):
        why = (check or {}).get("skipped") or (check or {}).get("reason") or "never checked"
        return f"the {export} export did not pass served == trained ({clip(why, 80)})"
    return None


def upload_files(folder: Path) -> list[str]:
    """Every file under `folder` to upload, relative, sorted (markers and README left out)."""
    found = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    return sorted(f for f in found if f not in LEFT_OUT and not f.startswith("."))


def upload(opts: PushOptions, folder: Path, files: list[str], card: str) -> tuple[str, str]:
    """One commit with every file and the card; (repo url, commit id)."""
    # lazy: heavy to import (huggingface_hub, httpx)
    import httpx
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    api = HfApi()  # its token: HF_TOKEN or the cached login, resolved by huggingface_hub
    ops = [CommitOperationAdd(path_in_repo=f, path_or_fileobj=str(folder / f)) for f in files]
    ops.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode()))
    try:
        url = api.create_repo(opts.repo, private=opts.private, exist_ok=True)
        info = api.create_commit(url.repo_id, ops, commit_message="moetune push")
    except (HfHubHTTPError, OfflineModeIsEnabled, httpx.HTTPError, OSError, ValueError) as exc:
        raise PushError(f"the Hub refused the push to {opts.repo}: {clip(masked(str(exc)), 200)}",
                        "check HF_TOKEN (a write token) or `hf auth login`, the repo name, "
                        "and that HF_HUB_OFFLINE is not set") from None  # fmt: skip
    return str(url), str(info.oid)
