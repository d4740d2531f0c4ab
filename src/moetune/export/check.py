"""Served == trained: run an export through its consumer and compare it with the peft adapter.

On the run's eval items (the prompts of its ladder), the peft adapter on the base
(float32) is the reference. Each consumer (transformers for `merged`, llama.cpp for
`gguf`, … – a registry keyed by format) returns its logits over the reference's token
sequence (prompt + the reference's greedy continuation, so both sides see the same
tokens) and its own greedy continuation. The check passes when, as medians over items
(top-k routing is discontinuous: in bf16 one item can flip an expert at one token, which
must not fail a sound export, while a consumer that drops expert LoRA is off on all items)
  * the logits' relative error is within the export dtype's tolerance,
  * that error is below a quarter of the item's *expert effect* – how far the adapter's
    logits move when only its expert LoRA is switched off – so a consumer that silently
    drops expert LoRA fails even where the attention LoRA alone would look close, and
  * greedy outputs agree on at least `min_greedy` of the items.
A consumer with kernels of its own (llama.cpp) differs from transformers even without any
adapter, and its error grows with the weights' contribution (a random base's is near zero):
it also serves the merged weights (the LoRA merged in), and its tolerance is `OWN_FACTOR` ×
that merged-vs-merged error (against transformers on the same merged weights) where this is
above the dtype's – the adapter as served may add nothing beyond the consumer's own numeric
error on the trained weights (measured per consumer, per check).
An adapter whose expert LoRA moves nothing measurable cannot be told apart from one
served without it: that fails too, with the reason.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median
from typing import Any, cast

import torch

from moetune.config import ModelArgs, load_config
from moetune.data.tokenizer import TokenizerError, load_tokenizer
from moetune.errors import MoetuneError
from moetune.export import load_formats
from moetune.export.registry import ExportError, Source
from moetune.export.source import item_texts

TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}  # rel. logits error
EFFECT_SHARE = 0.25  # the consumer's error must stay below this share of the expert effect
# The LoRA path may differ by at most this factor × the consumer's own merged-vs-merged
# error (LoRA adds a few matmuls in its kernels; a dropped expert LoRA is ~1, far above)
OWN_FACTOR = 3.0


class CheckFailed(MoetuneError):
    """The exported artifact does not serve what was trained."""

    exit_code = 1


class ConsumerUnavailable(Exception):
    """The format's consumer cannot run here (not installed, an input missing): not checked."""


def run_in_venv(
    env_var: str, missing: str, args: list[str], job: dict[str, Any], failed: str,
    limit: int = 160, env: dict[str, str] | None = None,
) -> str:  # fmt: skip
    """Run a consumer's runner script with the python of its own venv (named by `env_var`),
    the job as JSON on stdin; its stdout. ConsumerUnavailable with `missing` when there is no
    such python, with `failed` and its last stderr line when the runner fails."""
    python = os.environ.get(env_var, "")
    if not python or not Path(python).is_file():
        raise ConsumerUnavailable(missing)
    done = subprocess.run(
        [python, *args], input=json.dumps(job), capture_output=True, text=True, check=False,
        env=env,
    )  # fmt: skip
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConsumerUnavailable(f"{failed}: {last[:limit]}")
    return done.stdout


@dataclass
class Served:
    """What a consumer returned: logits per item `[T, V]` and greedy new tokens per item."""

    logits: list[torch.Tensor]
    greedy: list[list[int]]


# consumer(export dir, source, sequences to score, prompts, new tokens) -> Served
Consumer = Callable[[Path, Source, list[list[int]], list[list[int]], int], Served]


@dataclass
class OwnError:
    """The same merged weights served by the consumer and by transformers (logits per item)."""

    served: list[torch.Tensor]
    reference: list[torch.Tensor]


# baseline(export dir, source, sequences) -> the merged weights through both
Baseline = Callable[[Path, Source, list[list[int]]], OwnError]
CONSUMERS: dict[str, tuple[str, Consumer]] = {}  # format -> (consumer name, run)
BASELINES: dict[str, Baseline] = {}  # format -> its merged-vs-merged measurement


def register_consumer(fmt: str, name: str, run: Consumer, baseline: Baseline | None = None) -> None:
    """`baseline`: for a consumer with kernels of its own, the merged weights served by it
    and by transformers, so the check's floor is that consumer's own error on them."""
    CONSUMERS[fmt] = (name, run)
    if baseline is not None:
        BASELINES[fmt] = baseline


@dataclass
class CheckResult:
    """The verdict and the figures behind it (written to DIR/check.json)."""

    format: str
    consumer: str
    passed: bool
    items: int
    logits_rel: float  # median over items of the relative logits error
    expert_effect: float  # median over items of the expert LoRA's own effect
    effect_share: float  # median over items of error / effect
    greedy_match: float
    tolerance: float
    min_greedy: float
    logits_rel_max: float = 0.0  # the worst item (a routing flip in bf16 shows here)
    own_error: float | None = None  # median merged-vs-merged error of the consumer's kernels
    reason: str = ""
    per_item: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def greedy(step: Callable[[list[int]], torch.Tensor], prompt: list[int], new: int) -> list[int]:
    """Greedy continuation: `step(ids)` returns the next-token logits `[V]`."""
    ids = list(prompt)
    for _ in range(new):
        ids.append(int(torch.argmax(step(ids))))
    return ids[len(prompt) :]


def hf_served(model: Any, sequences: list[list[int]], prompts: list[list[int]], new: int) -> Served:
    """Logits and greedy outputs of a transformers (or peft) model, one item at a time."""

    @torch.no_grad()
    def logits(ids: list[int]) -> torch.Tensor:
        return model(input_ids=torch.tensor([ids])).logits[0].double()

    return Served(
        logits=[logits(s) for s in sequences],
        greedy=[greedy(lambda ids: logits(ids)[-1], p, new) for p in prompts],
    )


@dataclass
class Reference:
    """The peft adapter's outputs, and the same with its expert LoRA switched off."""

    sequences: list[list[int]]
    prompts: list[list[int]]
    served: Served
    without_experts: list[torch.Tensor]


def reference(source: Source, prompts: list[list[int]], new: int) -> Reference:
    # lazy: heavy to import (peft, moetune.export)
    from peft import PeftModel
    from peft.tuners.lora.layer import ParamWrapper

    from moetune.export.merged import load_base

    model = PeftModel.from_pretrained(
        load_base(source.base, torch.float32), str(source.adapter_dir)
    )
    served = hf_served(model.eval(), [], prompts, new)
    sequences = [p + g for p, g in zip(prompts, served.greedy, strict=True)]
    served.logits = hf_served(model, sequences, [], new).logits
    for module in model.modules():  # expert LoRA off: ΔW = 0 · B@A
        if isinstance(module, ParamWrapper):
            module.scaling = {k: 0.0 for k in module.scaling}
    without = hf_served(model, sequences, [], new).logits
    return Reference(sequences, prompts, served, without)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def tolerance(dtype: str, own_error: float | None) -> float:
    """The dtype's tolerance, raised to OWN_FACTOR × the consumer's merged-vs-merged error.
    NaN own error gives NaN (max() would drop it), which verdict_reason fails."""
    if own_error is not None and math.isnan(own_error):
        return math.nan
    return max(TOLERANCE.get(dtype, 3e-2), OWN_FACTOR * (own_error or 0.0))


def own_error(own: OwnError) -> float:
    """Median over items of the consumer vs transformers on the same merged weights."""
    return median(rel(g, r) for g, r in zip(own.served, own.reference, strict=True))


def compare(
    fmt: str, consumer: str, ref: Reference, got: Served, dtype: str, min_greedy: float,
    own_err: float | None = None,
) -> CheckResult:  # fmt: skip
    errors = [rel(g, r) for g, r in zip(got.logits, ref.served.logits, strict=True)]
    effects = [rel(w, r) for w, r in zip(ref.without_experts, ref.served.logits, strict=True)]
    same = [g == r for g, r in zip(got.greedy, ref.served.greedy, strict=True)]
    tol = tolerance(dtype, own_err)
    shares = [e / max(x, 1e-30) for e, x in zip(errors, effects, strict=True)]
    result = CheckResult(
        format=fmt, consumer=consumer, passed=False, items=len(errors),
        logits_rel=median(errors), expert_effect=median(effects), effect_share=median(shares),
        greedy_match=sum(same) / len(same), tolerance=tol, min_greedy=min_greedy,
        logits_rel_max=max(errors, key=lambda e: math.inf if math.isnan(e) else e),  # NaN: worst
        own_error=own_err,
        per_item=[
            {"logits_rel": e, "expert_effect": x, "greedy_equal": s}
            for e, x, s in zip(errors, effects, same, strict=True)
        ],
    )  # fmt: skip
    result.reason = verdict_reason(result)
    result.passed = not result.reason
    return result


def verdict_reason(r: CheckResult) -> str:
    """Why the check fails ('' when it passes). A statistic that is not a finite number
    fails it first: every comparison with NaN is false, so it would pass every test below."""
    stats = {"logits_rel": r.logits_rel, "logits_rel_max": r.logits_rel_max,
             "expert_effect": r.expert_effect, "effect_share": r.effect_share,
             "greedy_match": r.greedy_match, "tolerance": r.tolerance}  # fmt: skip
    bad = [f"{name} {value}" for name, value in stats.items() if not math.isfinite(value)]
    if bad:
        return (
            f"check statistics are not finite numbers ({', '.join(bad)}): the served model's "
            "or the adapter's logits hold NaN/Inf"
        )
    if r.expert_effect <= r.tolerance:
        return (
            f"the adapter's expert LoRA moves logits by only {r.expert_effect:.2g}: a consumer "
            "that drops it cannot be told apart"
        )
    if r.effect_share > EFFECT_SHARE:
        return (
            f"logits differ by {r.logits_rel:.3g}, {r.effect_share:.0%} of the expert LoRA's own "
            f"effect {r.expert_effect:.3g}: expert LoRA is not served as trained"
        )
    if r.logits_rel > r.tolerance:
        own = (
            ""
            if r.own_error is None
            else (f"; on the merged weights it differs from transformers by {r.own_error:.3g}")
        )
        return (
            f"logits differ from the peft adapter by {r.logits_rel:.3g} (tolerance "
            f"{r.tolerance:g}{own})"
        )
    if r.greedy_match < r.min_greedy:
        return f"greedy outputs agree on {r.greedy_match:.0%} of items (needed {r.min_greedy:.0%})"
    return ""


# ---------------------------------------------------------------- items, consumers, the run


def eval_texts(source: Source, items_file: Path | None, limit: int) -> list[str]:
    """Prompts of the run's eval ladder (or of `items_file`), at most `limit`, spread over rungs."""
    # lazy: heavy to import (moetune.evaluate)
    from moetune.evaluate.rungs import make_rung

    if items_file is not None:
        return item_texts(items_file, limit)
    if source.run_dir is not None:
        cfg = load_config(source.run_dir / "config.yaml")
        rungs = [make_rung(r) for r in cfg.eval.rungs if r.data]
    else:
        rungs = []
    if not rungs:  # bad input (exit 2), not a failed check
        raise ExportError(
            "no eval items to check the export on (an adapter dir without a run, or a run "
            "without eval data)",
            "pass the run dir, or --items FILE.jsonl with prompt/text rows, or --no-check",
        )
    per = max(1, limit // len(rungs))
    texts = [it.get("prompt") or it.get("text") for r in rungs for it in r.load(per)]
    return [t for t in texts if isinstance(t, str) and t][:limit]


def tokenizer_of(source: Source) -> Any:
    """The run's tokenizer (model.tokenizer, else the base's), checked as training checks
    it; else the one saved beside the adapter."""
    for where in (source.tokenizer_dir, str(source.adapter_dir)):
        try:
            return load_tokenizer(ModelArgs.model_validate({"id": where}))
        except TokenizerError:
            continue
    raise CheckFailed(
        f"no tokenizer next to the base {source.base} or the adapter",
        "copy the tokenizer files into the adapter dir, or pass --no-check",
    )


def merged_consumer(
    out: Path, source: Source, sequences: list[list[int]], prompts: list[list[int]], new: int
) -> Served:
    """The merged checkpoint in plain transformers (float32 compute, its stored values); one
    re-quantised (--requantize) read as a stored base is, its stacks dequantised."""

    # lazy: heavy to import (transformers, moetune.export)
    from transformers import AutoModelForCausalLM

    from moetune.export.merged import load_base
    from moetune.export.stored_base import stored_of

    if stored_of(str(out)) is not None:
        return hf_served(load_base(str(out), torch.float32), sequences, prompts, new)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = cast(Any, AutoModelForCausalLM).from_pretrained(
            str(out), dtype=torch.float32, output_loading_info=True
        )
    bad = {
        k: v
        for k, v in info.items()
        if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")
    }
    if bad:
        kind, keys = next(iter(bad.items()))
        raise CheckFailed(
            f"transformers loads the merged model with {len(keys)} {kind} ({sorted(keys)[0]})",
            "re-export",
        )
    return hf_served(model.eval(), sequences, prompts, new)


register_consumer("merged", "transformers", merged_consumer)


@dataclass(frozen=True)
class CheckOptions:
    """How many eval items, how many greedy tokens, how much greedy agreement is required."""

    items: int = 16
    new_tokens: int = 8
    min_greedy: float = 0.9
    items_file: Path | None = None


def check_export(
    source: Source, fmt: str, out: Path, dtype: str, opts: CheckOptions,
    texts: list[str] | None = None,
) -> CheckResult:  # fmt: skip
    """Run `fmt`'s consumer on `out` and compare with the adapter (ConsumerUnavailable when
    none runs here); on `texts`, else the eval texts of `opts`."""
    load_formats()  # each format module registers its consumer with itself
    if fmt not in CONSUMERS:
        raise ConsumerUnavailable(f"no consumer of {fmt} runs here")
    name, consume = CONSUMERS[fmt]
    tokenizer = tokenizer_of(source)
    if texts is None:
        texts = eval_texts(source, opts.items_file, opts.items)
    prompts = [list(tokenizer(t)["input_ids"]) for t in texts]
    baseline = BASELINES.get(fmt)
    ref = reference(source, prompts, opts.new_tokens)
    got = consume(out, source, ref.sequences, prompts, opts.new_tokens)
    err = None if baseline is None else own_error(baseline(out, source, ref.sequences))
    return compare(fmt, name, ref, got, dtype, opts.min_greedy, err)
