"""Loading a base for expert parallelism: each rank reads only its own experts' bytes.

The model is built with meta Parameters; every tensor but the routed expert stacks streams
in through transformers' loader (quant/load.py's `_stream`, the offload path's), and each
stack's place in the safetensors files – fused keys or one tensor per expert, through a
sharded index (stack_files.stack_segments) – is cut to this rank's experts
(stack_files.expert_part) and read by offset. So a node's host RAM at load holds one base
(N ranks × 1/N of the experts, the rest N times), not N of them, and no rank ever holds
another rank's experts.

Every experts dtype loads so:

* bf16 / the files' float dtype: this rank's experts, cast to the compute dtype;
* int8 / NF4 (`load_partitioned_quantized`): this rank's float experts read, then quantised
  on the CPU (quant/stacks.py, as one process quantises them: per expert, so the same
  bytes); the other ranks' experts are never read, let alone quantised;
* a base published quantised (`load_partitioned_stored`: FP8 / MXFP4 / NVFP4 / INT4 / GPTQ /
  AWQ): each stored buffer of a stack – weights, scales, zeros, g_idx – cut to this rank's
  experts (stored/load.py's StackFiles, every buffer expert-major) and read as stored.

Until `shard_experts` places them, each stack is a zero-storage stand-in of its full shape
(peft's `target_parameters` size every expert's LoRA factors from it: the adapter stays
whole), and this rank's part – a float tensor, or a QuantizedStack of its experts – waits
beside it (`PART`); `shard_experts` swaps it in.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from moetune.config.ep_split import check_divides
from moetune.engine.expert_parallel import PART, READ
from moetune.engine.offload.load import _Quant, empty_model
from moetune.engine.quant.load import _finish, _stream
from moetune.engine.quant.stacks import (
    QUANTIZED,
    QuantizedStack,
    QuantReport,
    _install,
    _mark_quantized,
)
from moetune.engine.stack_files import Segment, expert_part, keys_of, read_into, stack_segments
from moetune.engine.stored.load import StoredReport, install_stack
from moetune.engine.stored.load import stream_all_but_stacks as _stream_stored

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_DENSE = "use train.strategy ddp or fsdp for a dense model"


def load_partitioned(
    model_dir: str | Path, device: str | torch.device, dtype: torch.dtype, rank: int, ranks: int
) -> PreTrainedModel:
    """The causal LM of a local checkpoint, its routed expert stacks read for experts
    rank·E/N … (rank+1)·E/N − 1 only (bf16 / the files' float dtype, cast to `dtype`)."""
    return _load(model_dir, device, dtype, rank, ranks, None)


def load_partitioned_quantized(
    model_dir: str | Path, device: str | torch.device, dtype: torch.dtype, rank: int,
    ranks: int, method: str, double_quant: bool = False,
) -> tuple[PreTrainedModel, QuantReport]:  # fmt: skip
    """As `load_partitioned`, this rank's experts quantised to `method` (int8 / nf4) on the
    CPU as they are read; the report counts this rank's stacks."""
    quant = _Quant(method, double_quant)
    return _load(model_dir, device, dtype, rank, ranks, quant), quant.report


def _load(model_dir: str | Path, device: str | torch.device, dtype: torch.dtype, rank: int,
          ranks: int, quant: _Quant | None) -> Any:  # fmt: skip
    model, index, experts = empty_model(model_dir, dtype, "place on their ranks", _DENSE)
    check_divides(_shape(experts[0][1], experts[0][2][0])[0], ranks)
    plans = {(path, n): stack_segments(index, path, n, _shape(m, n))
             for path, m, names in experts for n in names}  # fmt: skip
    _stream(model, Path(model_dir), {"": str(device)}, dtype,
            skip=keys_of(index, (s for segs in plans.values() for s in segs)))  # fmt: skip
    read = [0, 0]
    for path, module, names in experts:
        for name in names:
            mine = _read_part(module, name, plans[(path, name)], rank, ranks, read)
            if quant is None:
                _hold(module, name, mine.to(device), _shape(module, name))
            else:  # quantised where it was read (the CPU), moved with the model
                _quantise(module, name, mine, replace(quant.plan, layer=path))
    _finish(model, device)
    model.__dict__[READ] = {"expert_bytes_read": read[0], "expert_stack_bytes": read[1]}
    return model


def _shape(module: nn.Module, name: str) -> tuple[int, ...]:
    return tuple(module._parameters[name].shape)  # type: ignore[union-attr]


def _read_part(module: nn.Module, name: str, segments: list[Segment], rank: int, ranks: int,
               read: list[int]) -> torch.Tensor:  # fmt: skip
    """This rank's experts of float stack `name`, read by offset and cast on the way to the
    stack's dtype (on the CPU)."""
    shape = _shape(module, name)
    local = shape[0] // ranks
    dtype = module._parameters[name].dtype  # type: ignore[union-attr]
    mine = torch.empty((local, *shape[1:]), dtype=dtype)
    read[0] += read_into(expert_part(segments, shape, slice(rank * local, (rank + 1) * local)),
                         mine)  # fmt: skip
    read[1] += sum(s.nbytes for s in segments)
    return mine


def _hold(module: nn.Module, name: str, mine: torch.Tensor, whole: tuple[int, ...]) -> None:
    """This rank's float experts beside a full-shape stand-in of the stack (no storage)."""
    module.__dict__.setdefault(PART, {})[name] = mine
    stand_in = torch.zeros((), dtype=mine.dtype, device=mine.device).expand(whole)
    module._parameters[name] = nn.Parameter(stand_in, requires_grad=False)


def _quantise(module: nn.Module, name: str, mine: torch.Tensor, plan: Any) -> None:
    """This rank's experts quantised (quant/stacks.py), held for shard_experts."""
    whole = _shape(module, name)
    _mark_quantized(module)
    _install(module, name, mine, plan)
    _hold_stack(module, name, whole)


def _hold_stack(module: nn.Module, name: str, whole: tuple[int, ...]) -> None:
    """The quantised stack just installed – this rank's experts – set aside (`PART`) behind a
    full-shape stand-in, as a float part is: peft sizes every expert's LoRA from it (reading
    the installed stack would dequantise this rank's experts only)."""
    stack = module.get_submodule(QUANTIZED)._modules.pop(name)
    assert isinstance(stack, QuantizedStack)
    local = next(iter(stack.stored().values())).shape[0]
    stack.shape = (local, whole[1], whole[2])
    module.__dict__.setdefault(PART, {})[name] = stack
    stand_in = torch.zeros((), dtype=stack.dtype, device=stack.device).expand(whole)
    module._parameters[name] = nn.Parameter(stand_in, requires_grad=False)


def load_partitioned_stored(
    model_dir: str | Path, device: str | torch.device, dtype: torch.dtype, rank: int,
    ranks: int, keep_linears: bool = False, dequantize: bool = False,
) -> tuple[PreTrainedModel, StoredReport]:  # fmt: skip
    """A base published quantised, its expert stacks read as stored for this rank's experts
    only (every buffer: weights, scales, zeros, g_idx); the other Linears as
    stored/load.load_stored loads them (`keep_linears`). `dequantize`: this rank's experts
    inflated to `dtype` (model.quantized_base: dequantize). The report counts this rank's."""
    model, stacks, report = _stream_stored(model_dir, device, dtype, keep_linears)
    check_divides(next(iter(stacks.values())).experts, ranks)
    read = [0, 0]
    for (path, name), files in stacks.items():
        module = model.get_submodule(path)
        whole = _shape(module, name)
        mine = files.part(rank, ranks)
        read[0], read[1] = read[0] + mine.nbytes, read[1] + files.nbytes
        stack = install_stack(module, name, mine.read(), dtype, report, device)
        if dequantize:  # a float part, as a float base's: no stored stack is kept
            del module.get_submodule(QUANTIZED)._modules[name]
            _hold(module, name, stack.dequantize(dtype), whole)
        else:
            _hold_stack(module, name, whole)
    report.float_bytes //= ranks  # install_stack counted every expert in float
    _finish(model, device)
    model.__dict__[READ] = {"expert_bytes_read": read[0], "expert_stack_bytes": read[1]}
    return model, report
