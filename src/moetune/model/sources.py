"""Where a model's config.json comes from: a local dir or file, the bundled catalog, or the hub.

Only config.json is ever fetched; planning needs no weights.
"""

from __future__ import annotations

import json
import socket
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from moetune.errors import ConfigError, ModelSourceError
from moetune.model.hf_config import HF_QUANT_CONFIG, with_hf_quant_config

META_KEY = "_moetune"  # catalog-only metadata inside each bundled config
HF_QUANT = "hf_quant_config"  # in META_KEY: a bundled entry's hf_quant_config.json, as published
_CATALOG_DIR = ("moetune.model", "catalog")  # package data, see pyproject


def resolve_config(model: str) -> tuple[str, dict[str, Any]]:
    """(name, config dict) for a local dir, a .json path, a catalog id or a hub id.

    Catalog ids match case-insensitively, with or without the organisation. Catalog
    metadata stays in the dict under "_moetune"; families strip it before transformers.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return model, read_config(path / "config.json")
    if path.is_file() or path.suffix == ".json":
        return model, read_config(path)
    entry = _catalog_lookup(model)
    if entry is not None:
        return entry
    if _looks_like_hub_id(model):
        return model, read_config(_download_config(model))  # beside it: a cached snapshot's
    raise ModelSourceError(
        f"{model!r} is not a directory, a .json file, a bundled model or a hub id",
        f"pass a local dir with config.json or a bundled id: {', '.join(catalog_ids())}",
    )


def read_config(path: Path) -> dict[str, Any]:
    """A local config.json with the quantisation an hf_quant_config.json beside it declares
    (ModelOpt's exports: model/hf_config.with_hf_quant_config)."""
    config = read_json(path)
    beside = path.parent / HF_QUANT_CONFIG
    return with_hf_quant_config(config, read_json(beside)) if beside.is_file() else config


def read_json(path: Path) -> dict[str, Any]:
    """A config.json as a dict; missing file -> ModelSourceError, bad JSON -> ConfigError."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelSourceError(
            f"{path} does not exist",
            "pass a directory that contains config.json, or the path of a config .json file",
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelSourceError(
            f"cannot read {path}: {exc}", "check the file's permissions"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})",
            "repair the file or download config.json again",
        ) from None
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise ConfigError(f"{path} holds a JSON {kind}, not an object", "use a model's config.json")
    return data


# --- bundled catalog ----------------------------------------------------------------


@cache
def _catalog() -> dict[str, dict[str, Any]]:
    """Bundled configs keyed by hub id (read once)."""
    entries: dict[str, dict[str, Any]] = {}
    for item in resources.files(_CATALOG_DIR[0]).joinpath(_CATALOG_DIR[1]).iterdir():
        if item.name.endswith(".json"):
            data = json.loads(item.read_text(encoding="utf-8"))
            entries[data[META_KEY]["id"]] = data
    return entries


def catalog_ids() -> list[str]:
    """Hub ids of the bundled model configs, sorted."""
    return sorted(_catalog())


def catalog_meta(model_id: str) -> dict[str, Any]:
    """The "_moetune" metadata of a bundled model (id, weights format, …); {} if not bundled."""
    entry = _catalog_lookup(model_id)
    return dict(entry[1][META_KEY]) if entry else {}


def _catalog_lookup(model: str) -> tuple[str, dict[str, Any]] | None:
    wanted = model.strip().lower()
    for model_id, data in _catalog().items():
        if wanted in (model_id.lower(), model_id.split("/")[-1].lower()):
            data = json.loads(json.dumps(data))  # a copy to mutate
            return model_id, _as_built(with_hf_quant_config(data, data[META_KEY].get(HF_QUANT)))
    return None


def _as_built(data: dict[str, Any]) -> dict[str, Any]:
    """A bundled config whose published model_type transformers lacks but whose code is a
    shipped architecture's (`builds_as`: Kimi-K2's `kimi_k2` ships DeepSeek-V3's modeling
    file) gets that model_type, so it builds without running the checkpoint's own code."""
    builds_as = data[META_KEY].get("builds_as")
    if builds_as:
        data[META_KEY]["published_model_type"] = data["model_type"]
        data["model_type"] = builds_as
    return data


# --- hub ----------------------------------------------------------------------------


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~"))


def _download_config(repo_id: str) -> Path:
    """config.json of `repo_id`: from the hub cache, else via hf_hub_download.

    Fails fast when offline or when the hub's host does not resolve: huggingface_hub
    retries network errors with backoff for ~20 s before giving up.
    """
    # lazy: heavy to import (huggingface_hub)
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(cached, str):
        return Path(cached)
    if constants.HF_HUB_OFFLINE:
        raise _hub_error(repo_id, "HF_HUB_OFFLINE is set and config.json is not cached")
    host = urlparse(constants.ENDPOINT).hostname or constants.ENDPOINT
    if not _resolves(host):
        raise _hub_error(repo_id, f"cannot resolve {host}: offline or unreachable")
    try:
        return Path(hf_hub_download(repo_id, "config.json"))
    except Exception as exc:  # the hub raises many types (404, gated, HTTP, OS)
        raise _hub_error(repo_id, _hub_cause(exc)) from None


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return False
    return True


def _hub_error(repo_id: str, cause: str) -> ModelSourceError:
    return ModelSourceError(
        f"cannot fetch config.json of {repo_id!r} from the hub ({cause})",
        "pass a local dir with config.json or a bundled id: " + ", ".join(catalog_ids()),
    )


def _hub_cause(exc: Exception) -> str:
    """One line on why the hub failed: offline, unknown repo, gated, or the error itself."""
    kind = type(exc).__name__
    known = {
        "OfflineModeIsEnabled": "HF_HUB_OFFLINE is set and the file is not cached",
        "LocalEntryNotFoundError": "offline or unreachable, and the file is not cached",
        "RepositoryNotFoundError": "no such repository, or it is private",
        "GatedRepoError": "the repository is gated: accept its terms and log in",
        "EntryNotFoundError": "the repository has no config.json",
    }
    if kind in known:
        return known[kind]
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{kind}: {first}"[:200]
