"""What a run reports while it trains: metrics.jsonl rows and a rich progress bar.

Both are plain `TrainerCallback`s; `quiet()` hides the libraries' own bars meanwhile.
Memory is the measured figure the planner is checked against: CUDA's allocated bytes
when training on a GPU, the process RSS otherwise.
"""

from __future__ import annotations

import contextlib
import math
import resource
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Column
from transformers import TrainerCallback

from moetune.engine.offload.store import offloaded_tensors
from moetune.model.finite import first_non_finite_of
from moetune.train.errors import TrainError
from moetune.units import human_bytes

# ---------------------------------------------------------------- memory


def _rss_bytes() -> int | None:
    """Current resident set size (Linux /proc); None where it cannot be read."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * resource.getpagesize()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since the last reset_peak_memory() (Linux's
    VmHWM), else since it started (ru_maxrss: KiB on Linux, bytes on macOS)."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(status.split("VmHWM:")[1].split()[0]) * 1024
    except (OSError, IndexError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


def memory_now() -> int:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.memory_allocated())
    return _rss_bytes() or peak_rss_bytes()


def peak_memory() -> tuple[int, str]:
    """(bytes, what was measured): CUDA peak allocated on a GPU, else the process peak RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated()), "cuda_max_memory_allocated"
    return peak_rss_bytes(), "process_peak_rss"


def reset_peak_memory() -> None:
    """The peak from here on: CUDA's counters, or on Linux the RSS high-water mark (so a run
    in a long-lived process – a notebook, the API, a test session – measures itself only)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
        return
    with contextlib.suppress(OSError):  # not Linux, or not allowed: the lifetime peak stands
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset VmHWM to the current RSS


# ---------------------------------------------------------------- metrics


_KEEP = {  # TRL/HF log key -> metrics.jsonl field
    "loss": "loss",
    "learning_rate": "lr",
    "grad_norm": "grad_norm",
    "aux_loss": "aux_loss",
    "mean_token_accuracy": "token_accuracy",
    "eval_loss": "eval_loss",
    "reward": "reward",  # grpo: mean summed reward of the sampled group
    "reward_std": "reward_std",
    "completions/mean_length": "completion_length",
    "kl": "kl",
    "rewards/accuracies": "reward_accuracy",  # dpo: share of pairs with chosen > rejected
    "rewards/margins": "reward_margin",
    "routing_shift": "routing_shift",  # grpo: ShiftCallback adds them to the loss row
    "routing_shift_top1": "routing_shift_top1",
}


ZERO_LOSS_STEPS = 3  # logged losses of exactly 0 from the start that stop a run


class MetricsCallback(TrainerCallback):
    """One metrics row per log: step, loss, lr, tokens/s, memory (+ aux loss when on, and
    `extra`'s figures: train.offload's reads); and, once training ends, `loop`: the tokens
    and tokens/s of the whole training loop."""

    def __init__(
        self,
        write: Callable[[dict[str, Any]], None],
        clock: Callable[[], float] = time.perf_counter,
        extra: Callable[[], dict[str, Any]] | None = None,
        zero_stop: int = 0,
    ) -> None:
        self.write, self.clock, self.extra = write, clock, extra
        # stop after this many logged losses of exactly 0 from the start (0: never)
        self.zero_stop, self._zeros = zero_stop, 0
        self.last: dict[str, Any] = {}
        self.loop: dict[str, Any] = {}
        self._mark = self._begin = (0.0, 0)
        self._step = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # after a resume's checkpoint is loaded: tokens count from where this attempt starts
        self._mark = self._begin = (self.clock(), state.num_input_tokens_seen)
        self._step = state.global_step

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Non-padding tokens over the loop's wall time (checkpoints and eval included, as a
        real run pays them; model loading and data preparation not)."""
        then, before = self._begin
        seconds, tokens = self.clock() - then, int(state.num_input_tokens_seen - before)
        rate = _significant(tokens / seconds) if tokens and seconds > 0 else None
        self.loop = {"tokens": tokens, "tokens_per_s": rate, "loop_seconds": round(seconds, 3)}

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any
    ) -> None:
        logs = logs or {}
        if not any(k in logs for k in ("loss", "eval_loss")):
            return  # the end-of-training summary log
        row: dict[str, Any] = {"step": state.global_step}
        row.update({out: logs[key] for key, out in _KEEP.items() if key in logs})
        if "loss" in logs:
            row.update(self._throughput(state.num_input_tokens_seen, state.global_step))
            row.update(self.extra() if self.extra is not None else {})
        if args.should_save:
            self.write(row)  # the diverged row is kept: it says when it happened
        self.last = {**self.last, **row}
        refuse_non_finite(row, kw.get("model"))
        self._refuse_zero_loss(row)

    def _refuse_zero_loss(self, row: dict[str, Any]) -> None:
        """A training loss of exactly 0 at each of the first `zero_stop` logged steps: no
        token carries loss (a float loss that learns is never exactly 0), so the run stops
        rather than report a perfect loss on an adapter that learned nothing."""
        if not self.zero_stop or "loss" not in row or self._zeros < 0:
            return
        self._zeros = self._zeros + 1 if row["loss"] == 0 else -1  # -1: it learns, done
        if self._zeros >= self.zero_stop:
            raise TrainError(
                f"loss is exactly 0 at each of the first {self._zeros} logged steps (to step "
                f"{row['step']}): no token carries loss, so the run learns nothing and was "
                "stopped",
                "run `moetune data` on this config: its samples show which tokens carry "
                "loss (in green); check the tokenizer (model.tokenizer) and the chat template",
            )

    def _throughput(self, tokens: int, step: int) -> dict[str, Any]:
        """Tokens/s (3 significant figures: a slow offload step is not "0") and seconds per
        optimizer step since the last loss row."""
        now = self.clock()
        (then, before), steps = self._mark, step - self._step
        self._mark, self._step = (now, tokens), step
        rate = (tokens - before) / (now - then) if now > then else 0.0
        per_step = round((now - then) / steps, 3) if steps > 0 else None
        return {"tokens": tokens, "tokens_per_s": _significant(rate), "step_seconds": per_step,
                "memory_bytes": memory_now()}  # fmt: skip


def _significant(value: float, digits: int = 3) -> float:
    """`value` to `digits` significant figures, at least one decimal (12345.6, 3.21, 0.0412)."""
    if value <= 0 or not math.isfinite(value):
        return 0.0
    return round(value, max(1, digits - 1 - math.floor(math.log10(value))))


def rate_text(tokens_per_s: float, step_seconds: float | None) -> str:
    """The progress bar's speed: tok/s with the decimals a slow run needs, and s/step once
    a step takes a second or more (where tok/s alone hides how long the wait is)."""
    if tokens_per_s >= 100:
        rate = f"{tokens_per_s:,.0f} tok/s"
    else:
        rate = f"{tokens_per_s:.3g} tok/s" if tokens_per_s >= 1 else f"{tokens_per_s:.2g} tok/s"
    slow = step_seconds is not None and step_seconds >= 1
    return f"{rate} · {step_seconds:.1f} s/step" if slow else rate


def refuse_non_finite(row: dict[str, Any], model: Any = None) -> None:
    """A NaN or Inf loss stops the run (TrainError): every later step would train on it,
    and the adapter saved at the end would be garbage. The trainer's own filter, which
    would log the running average in its place, is off (setup.py). A base weight that holds
    NaN is named as the cause, not the learning rate."""
    for key in ("loss", "eval_loss"):
        value = row.get(key)
        if isinstance(value, int | float) and not math.isfinite(value):
            if (found := _non_finite_base(model)) is not None:
                raise TrainError(
                    f"{key} is {value} at step {row['step']}: the base's weight {found[0]} "
                    f"holds {found[1]} NaN/Inf value(s) – not the learning rate",
                    "use a base whose weights are all finite (download or convert it again)",
                )
            raise TrainError(
                f"{key} is {value} at step {row['step']}: the run diverged, so it was stopped "
                "(the checkpoints before it are kept)",
                "lower train.learning_rate (or raise train.warmup_ratio) and start a new "
                "output.dir, or fix the rows that make the loss explode",
            )


def _non_finite_base(model: Any) -> tuple[str, int] | None:
    """The first frozen weight holding NaN/Inf: the resident ones, then the expert stacks
    offloaded to host RAM or disk (train.offload) – checked only once the loss is NaN."""
    if model is None:
        return None
    frozen = ((n, p) for n, p in model.named_parameters() if not p.requires_grad)
    with torch.no_grad():
        found = first_non_finite_of(chain(frozen, offloaded_tensors(model)))
    if found is None:
        return None
    # the name the base's files use: peft's wrappers (base_model.model., base_layer.) left out
    return found[0].removeprefix("base_model.model.").replace("base_layer.", ""), found[1]


# ---------------------------------------------------------------- progress


INFO_COLUMN = Column(ratio=1, no_wrap=False, overflow="fold")  # wraps, never cut with "…"


class RichProgress(TrainerCallback):
    """A rich progress bar: steps, loss, tokens/s and memory from `metrics`; with
    train.offload, `stream` says after every step what the store read and what bound it."""

    def __init__(
        self,
        metrics: MetricsCallback,
        console: Console,
        stream: Callable[[], str] | None = None,
    ) -> None:
        self.metrics, self.console, self.stream = metrics, console, stream
        self.progress: Progress | None = None
        self.task: Any = None
        self.info = self.streamed = ""  # the last log's figures; the last step's reads

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero or self.console.quiet:
            return
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}", table_column=INFO_COLUMN),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
        )
        self.task = self.progress.add_task(
            "train", total=state.max_steps, completed=state.global_step, info=""
        )
        self.progress.start()
        if self.stream is not None:  # marks the start: reads before training are no step's
            self.stream()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.progress is None:
            return
        self.streamed = f" · {self.stream()}" if self.stream is not None else ""
        self.progress.update(self.task, completed=state.global_step, info=self.info + self.streamed)

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        last = self.metrics.last
        if self.progress is None or "loss" not in last:
            return
        speed = rate_text(last["tokens_per_s"], last.get("step_seconds"))
        self.info = f"loss {last['loss']:.4f} · {speed} · {human_bytes(last['memory_bytes'])}"
        self.progress.update(self.task, info=self.info + self.streamed)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


@contextmanager
def quiet() -> Iterator[None]:
    """No datasets/transformers progress bars (moetune draws its own), restored after."""
    # lazy: heavy to import (datasets, transformers)
    import datasets
    from transformers.utils import logging as hf_logging

    ds_on, hf_on = datasets.is_progress_bar_enabled(), hf_logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if ds_on:
            datasets.enable_progress_bars()
        if hf_on:
            hf_logging.enable_progress_bar()
