"""What goes onto the pod: the run config rewritten to pod-local paths, and the files it
names (a local base model dir, training data, every rung's data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moetune.config import RunConfig
from moetune.lane.secrets import plain_env

REMOTE_RUN = "run"  # output.dir on the pod, relative to the pod's workdir
REMOTE_CONFIG = "run.yaml"


@dataclass
class Staging:
    """The pod's config plus (local path, remote path) pairs to copy in."""

    config: RunConfig
    files: list[tuple[Path, str]] = field(default_factory=list)
    local_model: bool = False


def _stage(files: list[tuple[Path, str]], local: str | None, remote: str) -> str | None:
    if local is None:
        return None
    files.append((Path(local), remote))
    return remote


def _stage_sources(out: Staging, pod: RunConfig) -> None:
    """data.sources / eval_sources on this machine (files or dirs) and a data.chat_template
    file go with the run; hub ids are fetched on the pod."""
    for key in ("sources", "eval_sources"):
        for n, src in enumerate(getattr(pod.data, key)):
            if Path(src.path).exists():
                remote = f"data/{key}/{n}{Path(src.path).suffix}"
                src.path = _stage(out.files, src.path, remote) or src.path
    template = pod.data.chat_template
    if template and Path(template).is_file():
        pod.data.chat_template = _stage(out.files, template, "data/chat_template.jinja")


def staging(cfg: RunConfig) -> Staging:
    """The pod's copy of `cfg`: same run, every path pointing inside the pod's workdir."""
    pod = cfg.model_copy(deep=True)
    out = Staging(pod)
    if Path(cfg.model.id).exists():  # a local base: copied in; a hub id is fetched on the pod
        pod.model.id = _stage(out.files, cfg.model.id, "model") or cfg.model.id
        out.local_model = True
    if cfg.model.tokenizer and Path(cfg.model.tokenizer).is_dir():  # model.tokenizer alike
        pod.model.tokenizer = _stage(out.files, cfg.model.tokenizer, "tokenizer")
    for attr in ("train_file", "eval_file"):
        local = getattr(cfg.data, attr)
        name = f"data/{attr}{Path(local).suffix}" if local else ""
        setattr(pod.data, attr, _stage(out.files, local, name))
    _stage_sources(out, pod)
    for rung in pod.eval.rungs:
        if rung.data:
            rung.data = _stage(
                out.files, rung.data, f"data/eval/{rung.name}{Path(rung.data).suffix}"
            )
        if rung.include_path:
            rung.include_path = _stage(out.files, rung.include_path, f"tasks/{rung.name}")
    pod.output.dir = REMOTE_RUN
    pod.output.ledger = "ledger.jsonl"
    pod.eval.results_dir = None
    pod.lane.provider = "local"  # on the pod, the run is local
    # secrets reach the pod by its environment only
    pod.lane.env = plain_env(cfg.lane.env, cfg.lane.public_env)
    return out
