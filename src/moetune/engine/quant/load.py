"""Quantise expert stacks while loading a checkpoint: the model is built with meta
Parameters and tensors stream one at a time, each expert stack quantised on the CPU before
its quantised storage moves to the device – the whole model never exists in float there.
Relies on transformers 5.23–5.24 loading internals (the pinned range)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

import torch

from moetune.engine.quant.stacks import (
    _PENDING,
    QuantError,
    QuantReport,
    _mark_quantized,
    _Plan,
    experts_modules,
    quantizer_for,
)
from moetune.model.derive import causal_lm_class, ensure_backbone
from moetune.model.weight_files import checkpoint_files

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_SYNC_LOAD = {"HF_DEACTIVATE_ASYNC_LOAD": "1"}  # see _stream


def load_quantized(
    model_dir: str | Path, experts_dtype: str, device: str | torch.device,
    dtype: torch.dtype = torch.bfloat16, *, double_quant: bool = False,
    error_experts: int | None = 8,
) -> tuple[PreTrainedModel, QuantReport]:  # fmt: skip
    """A causal LM from a local checkpoint, its expert stacks quantised while loading.

    The model is built with meta Parameters; tensors stream one at a time from the
    safetensors files through transformers' own key conversions (per-expert keys fused
    as in `from_pretrained`). Each expert stack is materialised on the CPU, quantised
    there, and only its quantised storage moves to `device`; the rest loads onto `device`.
    """
    # lazy: heavy to import (accelerate, transformers)
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    backend = quantizer_for(experts_dtype, double_quant=double_quant)
    config = AutoConfig.from_pretrained(model_dir)
    # buffers stay real: rotary frequencies are computed at init, never stored
    with init_empty_weights(include_buffers=False):
        model = ensure_backbone(causal_lm_class(config)._from_config(config, dtype=dtype))
    report = QuantReport(experts_dtype, double_quant, backend.name)
    plan = _Plan(experts_dtype, double_quant, report, "", torch.device(device), error_experts)
    staged = []
    for path, module, names in list(experts_modules(model)):
        _mark_quantized(module)  # its __setattr__ now quantises these names as they arrive
        module.__dict__[_PENDING] = dict.fromkeys(names, replace(plan, layer=path))
        staged.append(path)
    _stream(model, Path(model_dir), expert_device_map(staged, device), dtype)
    _finish(model, device)
    return model, report


def expert_device_map(expert_paths: list[str], device: str | torch.device) -> dict[str, Any]:
    """transformers device map: experts modules stage on the CPU, the rest on `device`."""
    return {"": str(device), **dict.fromkeys(expert_paths, "cpu")}  # keys act as regex prefixes


def _stream(model: PreTrainedModel, model_dir: Path, device_map: dict[str, Any],
            dtype: torch.dtype, skip: frozenset[str] | set[str] = frozenset(),
            extra: dict[str, Any] | None = None) -> None:  # fmt: skip
    """One tensor at a time through the loader `from_pretrained` uses (transformers 5.23–5.24);
    keys in `skip` are not read (offloaded or stored expert stacks); `extra` adds tensors read
    lazily (`x[...]`: quantised Linears, dequantised as they load)."""
    # lazy: heavy to import (safetensors, transformers)
    from safetensors import safe_open
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    files = checkpoint_files(model_dir)  # the one decision every loader reads
    if not files:
        raise QuantError(f"no *.safetensors files in {model_dir}.",
                         "save the model with save_pretrained (safetensors).")  # fmt: skip
    load = LoadStateDictConfig(device_map=device_map, dtype=dtype,
                               dtype_plan=model._get_dtype_plan(dtype),
                               weight_mapping=get_model_conversion_mapping(model))  # type: ignore[arg-type]  # fmt: skip
    # async loading reads every tensor ahead into futures: all stacks in float at once
    with contextlib.ExitStack() as files_open, mock.patch.dict(os.environ, _SYNC_LOAD):
        handles = [files_open.enter_context(safe_open(str(f), framework="pt")) for f in files]
        slices = {k: h.get_slice(k) for h in handles for k in h.keys() if k not in skip}  # noqa: SIM118
        slices.update(extra or {})
        info, _ = convert_and_load_state_dict_in_model(model, slices, load)
    if info.mismatched_keys or info.conversion_errors:
        bad = sorted(map(str, [*info.mismatched_keys, *info.conversion_errors]))[:3]
        raise QuantError(f"checkpoint in {model_dir} does not match its config: {bad}.",
                         "check that config.json belongs to these weights.")  # fmt: skip


def _finish(model: Any, device: str | torch.device) -> None:
    for module in model.modules():
        module.__dict__.pop(_PENDING, None)  # a stack never set is still a meta Parameter
    model.tie_weights()
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise QuantError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}.",
                         "point at the complete model directory.")  # fmt: skip
    model.to(device)  # the experts' small tensors (biases) were staged on the CPU
    model.eval()
