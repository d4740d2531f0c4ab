"""Exports over a base published quantised (block FP8, MXFP4, NVFP4, INT4:
engine/stored/formats.py).

The base is read by moetune itself (`engine.stored.load`) – never by transformers'
`from_pretrained`, which dequantises FP8 silently on a CPU and refuses to train MXFP4 – and
every expert stack is dequantised in place, so the merge adds ΔW to exactly the weights the
adapter was trained over. `--format merged` writes those floats (bf16 unless --dtype says
otherwise) with no quantization_config; `--requantize` writes them back in the base's stored
format and first measures, per expert stack, how much of ΔW the rounding leaves:

    survival = 1 − ‖(deq(requant(W + ΔW)) − deq(W_stored)) − ΔW‖ / ‖ΔW‖

(1: every bit of the LoRA effect is served; 0 or below: none of it). Below the floor
(`SURVIVAL_FLOOR`, or --survival-floor) the export is refused and nothing is written.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from moetune.engine.quant.stacks import QuantizedStack, stacks_of
from moetune.engine.stored.formats import StoredFormat
from moetune.export.registry import ExportError, ExportOptions, Source

SURVIVAL_FLOOR = 0.5  # below it a re-quantised merge serves less than half the LoRA effect
Stored = tuple[type[StoredFormat], dict[str, Any]]


class SurvivalTooLow(ExportError):
    """Re-quantising the merged weights rounds away too much of the adapter's ΔW."""


def stored_of(base: str) -> Stored | None:
    """The stored format of a local base dir's config.json (None: a float or hub base)."""
    # lazy: heavy to import (engine.stored.load: transformers)
    from moetune.engine.stored.load import checkpoint_format

    return checkpoint_format(base)  # None where no config.json can be read


def load_dequantized(base: str, dtype: torch.dtype) -> tuple[Any, dict[str, QuantizedStack], bool]:
    """The stored base with every expert stack a float Parameter of `dtype`; the stacks as they
    were stored (by parameter name) and whether other Linears were quantised too."""
    # lazy: heavy to import (engine.stored.load: transformers)
    from moetune.engine.stored.load import dequantize_stacks_, load_stored

    model, report = load_stored(base, "cpu", dtype)
    stacks = {f"{path}.{name}": stack for path, module in model.named_modules()
              for name, stack in stacks_of(module).items()}  # fmt: skip
    dequantize_stacks_(model, dtype)
    # the stored stream leaves no conversions: unset, save_pretrained writes the family's own
    # on-disk layout (per-expert keys where it has them), as for a float base
    cast(Any, model)._weight_conversions = None
    return model.eval(), stacks, bool(report.dequantized)


def stack_survival(
    merged: torch.Tensor, stack: QuantizedStack, fmt: type[StoredFormat], options: dict[str, Any]
) -> tuple[float, float]:
    """(‖lost‖², ‖ΔW‖²) of one stack: what re-quantising W + ΔW leaves of ΔW."""
    base = stack.dequantize(torch.float32)
    merged = merged.detach().float()
    canonical = merged.transpose(1, 2) if stack.transposed else merged
    again = fmt.dequantize(
        fmt.quantize(canonical.contiguous(), **options), stack.out_in, torch.float32
    )
    again = again.transpose(1, 2) if stack.transposed else again
    d = merged - base
    return float(((again - base) - d).pow(2).sum()), float(d.pow(2).sum())


def survival(
    model: Any, stacks: dict[str, QuantizedStack], fmt: type[StoredFormat], options: dict[str, Any]
) -> dict[str, Any]:
    """Survival per expert stack with a ΔW, overall (norms pooled) and the worst."""
    params = dict(model.named_parameters())
    per: dict[str, float] = {}
    lost_sq = delta_sq = 0.0
    for name, stack in stacks.items():
        lost, delta = stack_survival(params[name], stack, fmt, options)
        if delta > 0:
            per[name] = 1 - math.sqrt(lost / delta)
            lost_sq, delta_sq = lost_sq + lost, delta_sq + delta
    if not per:
        return {"survival": None, "worst": None, "worst_stack": None, "stacks": {}}
    worst = min(per, key=per.__getitem__)
    overall = 1 - math.sqrt(lost_sq / delta_sq)
    return {"survival": overall, "worst": per[worst], "worst_stack": worst, "stacks": per}


def refuse_low(figures: dict[str, Any], label: str, floor: float) -> None:
    if figures["survival"] is not None and figures["survival"] < floor:
        raise SurvivalTooLow(
            f"re-quantised to {label}, the merge keeps {figures['survival']:.0%} of the expert "
            f"LoRA effect (worst {figures['worst_stack']}: {figures['worst']:.0%}; floor "
            f"{floor:.0%})",
            "export without --requantize (bf16 merge) or serve the adapter over the base "
            "(--format vllm)",
        )


def export_requantized(
    source: Source, out: Path, opts: ExportOptions, dtype: torch.dtype,
    merge_into: Callable[[Any, Source], dict[str, Any]],
) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """Merge (`merge_into`, merged.py's) in float32, measure survival (refused below the
    floor), write `out` in the base's stored format with the other tensors in `dtype`;
    (merge counts, survival figures)."""
    # lazy: heavy to import (engine.stored.write)
    from moetune.engine.stored.write import write_stored

    fmt, qcfg = need_stored(source.base)
    model, stacks, rest = load_dequantized(source.base, torch.float32)
    counts = merge_into(model, source)
    options = fmt.options(qcfg)
    figures = {"format": fmt.name, **survival(model, stacks, fmt, options)}
    refuse_low(figures, fmt.label, float(opts.extra.get("survival_floor", SURVIVAL_FLOOR)))
    floats = out / ".float"
    model.save_pretrained(str(floats))
    del model
    write_stored(floats, out, fmt.name, rest=rest, dtype=dtype, **options)
    shutil.rmtree(floats)
    set_config_dtype(out, dtype)
    return counts, figures


def need_stored(base: str) -> Stored:
    found = stored_of(base)
    if found is None:
        raise ExportError(
            "--requantize writes the merge back in the base's stored format, and this base "
            "has no quantization_config",
            "drop --requantize (the merge is written in the base's own dtype)",
        )
    return found


def set_config_dtype(out: Path, dtype: torch.dtype) -> None:
    """config.json states the dtype the unquantised tensors are written in."""
    path = out / "config.json"
    config = json.loads(path.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    path.write_text(json.dumps(config, indent=2))
