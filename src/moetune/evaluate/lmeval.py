"""Rung kind `lm_eval`: a task of lm-evaluation-harness, scored per item on a loaded model.

Offline and local: the task comes from a YAML in `include_path` (`dataset_path: json`,
`dataset_kwargs.data_files: …`), the model is the one moetune already holds (base, then
base + adapter), and `log_samples` gives the per-document metric that makes the base and
candidate scores paired. lm-eval is an optional extra: `pip install 'moetune[lmeval]'`.
"""

from __future__ import annotations

import functools
from typing import Any

from moetune.evaluate.errors import EvalError
from moetune.evaluate.rungs import Item, ItemScore, Rung, register_rung
from moetune.evaluate.scoring import Advance


def _harness() -> Any:
    try:
        # lazy: heavy to import (lm_eval)
        import lm_eval
    except ImportError:
        raise EvalError(
            "rung kind lm_eval needs lm-evaluation-harness, which is not installed",
            "pip install 'moetune[lmeval]' (or use kinds loss / exact_match / multiple_choice)",
        ) from None
    return lm_eval


@functools.lru_cache(maxsize=8)
def task_manager(include_path: str | None, task: str) -> Any:
    """The local tasks alone when they hold `task` (indexing lm-eval's thousands of built-in
    tasks takes ~15 s), else the full index; cached, so base and candidate share one."""
    # lazy: heavy to import (lm_eval)
    from lm_eval.tasks import TaskManager

    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if task in local.all_tasks:
            return local
    return TaskManager(include_path=include_path)


@register_rung
class LmEvalRung(Rung):
    """Per-document `metric` of an lm-eval task (documents ordered by doc_id)."""

    kind = "lm_eval"

    def load(self, limit: int | None) -> list[Item]:
        _harness()
        if not self.args.task:
            raise EvalError(
                f"rung {self.args.name!r} (lm_eval) names no task",
                "set eval.rungs[].task (and include_path for a local task YAML)",
            )
        self.limit = limit
        return []  # the harness reads its own documents; their count is known after scoring

    def score(
        self, model: Any, tokenizer: Any, items: list[Item], batch_size: int, advance: Advance
    ) -> list[ItemScore]:
        samples = self._samples(model, tokenizer, batch_size)
        metric = self.args.metric
        if samples and metric not in samples[0]:
            known = sorted(k for k, v in samples[0].items() if isinstance(v, int | float))
            raise EvalError(
                f"rung {self.args.name!r}: task {self.args.task} has no metric {metric!r}",
                f"set eval.rungs[].metric to one of: {', '.join(known)}",
            )
        advance(len(samples))
        return [ItemScore(float(s[metric]), s.get("filtered_resps")) for s in samples]

    def _samples(self, model: Any, tokenizer: Any, batch_size: int) -> list[dict[str, Any]]:
        harness = _harness()
        # lazy: heavy to import (lm_eval)
        from lm_eval.models.huggingface import HFLM

        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        task = str(self.args.task)
        manager = task_manager(self.args.include_path, task)
        try:
            out = harness.simple_evaluate(
                model=lm, tasks=[task], task_manager=manager, limit=self.limit,
                log_samples=True, verbosity="ERROR",
            )  # fmt: skip
        except KeyError as err:
            raise EvalError(
                f"rung {self.args.name!r}: lm-eval knows no task {task!r} ({err})",
                "check eval.rungs[].task and include_path (a folder with the task YAML)",
            ) from None
        return sorted(out["samples"][task], key=lambda s: s["doc_id"])
