"""`run_eval(cfg)`: score base and candidate on every rung of the ladder, then gate.

1. every rung's items are read and checked before any model is loaded;
2. the base is loaded once and scored on every rung; then the adapter is put on the same
   model (peft) and the candidate is scored on the same items;
3. results go to a temp dir renamed into place in one step – ladder.json (every rung's
   summary: score, stderr and n of base and candidate, Δ, SE_Δ, its gate settings), the
   same per rung in rungs/<name>.json, and rungs/<name>.items.jsonl (per item: base and
   candidate score and output, so every difference is paired and inspectable);
4. the gate decides (verdict.json); eval and gate each leave a ledger row.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from moetune.config import RunConfig
from moetune.data.rendering import RAW, Rendering
from moetune.data.template import use_template
from moetune.data.tokenizer import load_tokenizer
from moetune.errors import clip, os_problem
from moetune.evaluate.errors import EvalError
from moetune.evaluate.gate import gate_results, paired
from moetune.evaluate.results import (
    LADDER,
    RUNGS,
    adapter_digest,
    publish,
    refuse_unasked_replace,
)
from moetune.evaluate.rungs import Item, ItemScore, Rung, make_rung
from moetune.io import PROMOTION_FIX, atomic_write_json, atomic_write_text, promotion_broken
from moetune.ledger import attempt
from moetune.model import load_spec
from moetune.model.finite import require_finite_adapter
from moetune.model.weight_files import check_weight_files
from moetune.train.rundir.checkpoint import ledger_fields


@dataclass
class Scored:
    """One rung with its items and both models' per-item scores."""

    rung: Rung
    items: list[Item]
    base: list[ItemScore] | None = None
    candidate: list[ItemScore] | None = None


def resolve_adapter(cfg: RunConfig, adapter: str | Path | None) -> Path:
    path = Path(adapter) if adapter else Path(cfg.output.dir) / "adapter"
    if not (path / "adapter_config.json").is_file():
        raise EvalError(
            f"no peft adapter at {path} (adapter_config.json missing)",
            "train first (`moetune train run.yaml`) or pass --adapter DIR",
        )
    return path


def check_eval_args(limit: int | None, batch_size: int) -> None:
    """Refuse counts that would silently drop items (a negative slice) or crash mid-scoring."""
    if limit is not None and limit < 1:
        raise EvalError(
            f"--limit / eval.limit {limit} is not a positive number of items",
            "pass --limit N with N >= 1, or leave it out to score every item",
        )
    if batch_size < 1:
        raise EvalError(
            f"eval.batch_size {batch_size} is not a positive number of items per pass",
            "set eval.batch_size to 1 or more (e.g. --set eval.batch_size=32)",
        )


def load_ladder(cfg: RunConfig, limit: int | None) -> list[Scored]:
    if not cfg.eval.rungs:
        raise EvalError(
            "the run config has no eval ladder (eval.rungs is empty)",
            "add eval.rungs: [{name, kind, role, data}] (see `moetune schema`)",
        )
    limit = limit if limit is not None else cfg.eval.limit
    check_eval_args(limit, cfg.eval.batch_size)
    return [Scored(rung, rung.load(limit)) for rung in map(make_rung, cfg.eval.rungs)]


def run_rendering(cfg: RunConfig) -> tuple[Rendering, str | None]:
    """How the run's rows became text (its data.json, written by train): the eval renders
    its prompts the same way. No record (no run trained in output.dir): as written, and a
    note that says so."""
    path = Path(cfg.output.dir) / "data.json"
    try:
        doc = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        doc = {}
    if isinstance(doc, dict) and "rendering" in doc:
        return Rendering.from_json(doc["rendering"]), None
    note = f"{path} records no row rendering (no run trained there): prompts are scored "
    return RAW, note + "as written, not through a chat template"


def eval_tokenizer(cfg: RunConfig, rendering: Rendering) -> Any:
    """The tokenizer as training set it up (data.chat_template on it), checked to carry the
    template the run trained with."""
    spec = load_spec(cfg.model.id, cfg.model.trust_remote_code)
    tokenizer = load_tokenizer(cfg.model, spec.vocab_size)  # refused as train refuses it
    use_template(tokenizer, cfg.data.chat_template)
    rendering.check_tokenizer(tokenizer)
    return tokenizer


def load_model(cfg: RunConfig) -> Any:
    """The base model, placed like training would place it."""
    # lazy: heavy to import (torch, moetune.engine, moetune.train)
    import torch

    from moetune.engine.resolve import resolve_engine
    from moetune.train.model import load_model as load_weights
    from moetune.train.setup import resolve_placement
    from moetune.train.stored import stored_base

    place = resolve_placement(cfg.train)
    spec = load_spec(cfg.model.id, cfg.model.trust_remote_code)
    engine = resolve_engine(spec, cfg.lora, cfg.model.experts_dtype, cfg.model.quantized_base)
    stored, dtype = stored_base(cfg, spec), place.load_dtype(cfg.model.dtype)
    model = load_weights(cfg, place, engine, stored, dtype).to(place.device)
    model.eval()
    torch.manual_seed(cfg.train.seed)
    return model


def _check_base_files(cfg: RunConfig, show: bool) -> None:
    """The base's checkpoint files whole (model.weight_files), read as the loader reads them;
    a stray weight file beside them named."""
    # lazy: heavy to import (moetune.engine via moetune.train.stored)
    from moetune.train.stored import own_reader

    local = Path(cfg.model.id).is_dir() and not cfg.model.is_gguf
    spec = load_spec(cfg.model.id, cfg.model.trust_remote_code) if local else None
    own = spec is not None and own_reader(cfg, spec)
    for note in check_weight_files(cfg.model.id, own):
        if show:
            Console(stderr=True).print(f"[yellow]warning:[/] {escape(note)}", highlight=False)


@contextmanager
def _bar(label: str, total: int, show: bool) -> Iterator[Any]:
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(
        *columns, TimeElapsedColumn(), console=Console(stderr=True), disable=not show
    ) as p:
        task = p.add_task(label, total=total)
        yield lambda n: p.advance(task, n)


def score_all(
    ladder: list[Scored], model: Any, tokenizer: Any, cfg: RunConfig, who: str, show: bool
) -> None:
    total = sum(len(s.items) for s in ladder)
    with _bar(f"eval {who}", total, show) as advance:
        for s in ladder:
            scores = s.rung.score(model, tokenizer, s.items, cfg.eval.batch_size, advance)
            setattr(s, who, scores)


def rung_summary(s: Scored) -> dict[str, Any]:
    assert s.base is not None and s.candidate is not None
    base, cand = [x.score for x in s.base], [x.score for x in s.candidate]
    stats = paired(base, cand, s.rung.unit)
    return {
        "name": s.rung.args.name,
        "kind": s.rung.kind,
        "role": s.rung.args.role,
        "unit": s.rung.unit,
        "n": stats.n,
        "base": {"score": stats.base, "stderr": _stderr(base)},
        "candidate": {"score": stats.candidate, "stderr": _stderr(cand)},
        "delta": stats.delta,
        "se_delta": stats.se,
        "extra": {f"base_{k}": v for k, v in s.rung.extra(base).items()}
        | {f"candidate_{k}": v for k, v in s.rung.extra(cand).items()},
        "args": s.rung.args.model_dump(mode="json"),
        "items_file": f"{RUNGS}/{s.rung.args.name}.items.jsonl",
    }


def _stderr(scores: list[float]) -> float:
    n = len(scores)
    if n < 2:
        return 0.0
    mean = sum(scores) / n
    return float((sum((x - mean) ** 2 for x in scores) / (n - 1) / n) ** 0.5)


def items_jsonl(s: Scored) -> str:
    assert s.base is not None and s.candidate is not None
    items = s.items or [{}] * len(s.base)  # lm_eval: the harness holds its documents
    rows = (
        {
            "i": i,
            "base": b.score,
            "candidate": c.score,
            "base_output": b.output,
            "candidate_output": c.output,
            **s.rung.shown(item),
        }
        for i, (item, b, c) in enumerate(zip(items, s.base, s.candidate, strict=True))
    )
    return "".join(json.dumps(row, default=str) + "\n" for row in rows)


def write_results(path: Path, ladder: list[Scored], meta: dict[str, Any]) -> dict[str, Any]:
    """Everything into a temp dir beside `path`, fsynced, then published into `path`
    (moetune's earlier files replaced, a user's own files kept); no temp dir is left."""
    tmp = path.parent / f".{path.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for s in ladder:
            atomic_write_text(tmp / RUNGS / f"{s.rung.args.name}.items.jsonl", items_jsonl(s))
        doc = {**meta, "results": str(path), "rungs": [rung_summary(s) for s in ladder]}
        for rung in doc["rungs"]:
            atomic_write_json(tmp / RUNGS / f"{rung['name']}.json", rung)
        atomic_write_json(tmp / LADDER, doc)
        publish(tmp, path)
    except OSError as exc:  # a full disk, a quota: one line, and no temp dir left behind
        raise EvalError(
            f"eval results could not be written beside {clip(path, 80)}: {os_problem(exc)}",
            "free space there (or set eval.results_dir to another disk), then rerun the eval",
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return doc


def run_eval(
    cfg: RunConfig,
    adapter: str | Path | None = None,
    *,
    limit: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Score base and candidate on the ladder, write results, gate; returns the verdict.
    The attempt leaves an `eval` ledger row (failed ones too), the gate a `gate` row."""
    with attempt(cfg.output.ledger, "eval", **ledger_fields(cfg)) as row:
        results, doc = score_ladder(cfg, adapter, limit, overwrite, progress)
        row["metrics"] = eval_metrics(doc)
    return gate_results(results)


def score_ladder(
    cfg: RunConfig, adapter: str | Path | None, limit: int | None, overwrite: bool, show: bool
) -> tuple[Path, dict[str, Any]]:
    # lazy: heavy to import (peft, moetune.engine)
    from peft import PeftModel

    from moetune.engine.forwards import apply_overrides

    started = time.perf_counter()
    ladder = load_ladder(cfg, limit)  # every item checked before any model loads
    adapter_dir = resolve_adapter(cfg, adapter)
    require_finite_adapter(adapter_dir)  # before any model loads or result is written
    if why := promotion_broken(adapter_dir):  # its marker vouches for other bytes
        raise EvalError(why, PROMOTION_FIX)
    results = cfg.eval.results_path(cfg.output.dir)
    refuse_unasked_replace(results, overwrite)
    _check_base_files(cfg, show)  # a damaged local base: one line, before any load
    rendering, note = run_rendering(cfg)
    tokenizer = eval_tokenizer(cfg, rendering)  # another template than trained: refused here
    for s in ladder:
        s.rung.rendering = rendering
    model = load_model(cfg)
    if note and show:  # once the model loaded: a refusal stays one line
        Console(stderr=True).print(f"[yellow]warning:[/] {escape(note)}", highlight=False)
    score_all(ladder, model, tokenizer, cfg, "base", show)
    with warnings.catch_warnings():  # peft calls a transformers API deprecated for v6
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        candidate = PeftModel.from_pretrained(model, str(adapter_dir))
    apply_overrides(candidate)  # as trained: dbrx's experts apply their LoRA
    score_all(ladder, candidate, tokenizer, cfg, "candidate", show)
    meta = {
        "model": cfg.model.id,
        "adapter": str(adapter_dir.resolve()),
        "adapter_sha256": adapter_digest(adapter_dir),
        # a copied or moved run dir promotes its own adapter (evaluated_adapter)
        "adapter_from_results": os.path.relpath(adapter_dir.resolve(), results.resolve()),
        "ledger": cfg.output.ledger,
        "gate": cfg.eval.gate.model_dump(mode="json"),
        "limit": limit if limit is not None else cfg.eval.limit,
        "rendering": rendering.to_json(),
        "seconds": round(time.perf_counter() - started, 3),
        "time": time.time(),
        **{k: v for k, v in ledger_fields(cfg).items() if k != "versions"},
    }
    return results, write_results(results, ladder, meta)


def eval_metrics(doc: dict[str, Any]) -> dict[str, Any]:
    scores = {
        r["name"]: {"base": r["base"]["score"], "candidate": r["candidate"]["score"], "n": r["n"]}
        for r in doc["rungs"]
    }
    return {"adapter": doc["adapter"], "results": doc.get("results"), "scores": scores}
