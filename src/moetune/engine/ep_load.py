"""Loading a base for expert parallelism: each rank reads only its own experts' bytes.

The model is built with meta Parameters; every tensor but the routed expert stacks streams
in through transformers' loader (quant/load.py's `_stream`, the offload path's), and each
stack's place in the safetensors files – fused keys or one tensor per expert, through a
sharded index (stack_files.stack_segments) – is cut to this rank's experts
(stack_files.expert_part) and read by offset. So a node's host RAM at load holds one base
(N ranks × 1/N of the experts, the rest N times), not N of them, and no rank ever holds
another rank's experts.

Until `shard_experts` places them, each stack is a zero-storage stand-in of its full shape
(peft's `target_parameters` size every expert's LoRA factors from it: the adapter stays
whole), and this rank's part waits beside it (`PART`); `shard_experts` swaps it in.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from moetune.engine.expert_parallel import PART, READ, check_divides
from moetune.engine.quant.load import _finish, _stream
from moetune.engine.quant.stacks import experts_modules
from moetune.engine.stack_files import (
    OffloadError,
    Segment,
    expert_part,
    index_dir,
    keys_of,
    read_into,
    stack_segments,
)
from moetune.model.derive import causal_lm_class, ensure_backbone

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def load_partitioned(
    model_dir: str | Path, device: str | torch.device, dtype: torch.dtype, rank: int, ranks: int
) -> PreTrainedModel:
    """The causal LM of a local checkpoint, its routed expert stacks read for experts
    rank·E/N … (rank+1)·E/N − 1 only (bf16 / the files' float dtype, cast to `dtype`)."""
    # lazy: heavy to import (accelerate, transformers)
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    with init_empty_weights(include_buffers=False):
        model = ensure_backbone(causal_lm_class(config)._from_config(config, dtype=dtype))
    index = index_dir(model_dir)
    experts = list(experts_modules(model))
    if not experts:
        raise OffloadError(f"{config.model_type} has no fused routed experts to place",
                           "use train.strategy ddp or fsdp for a dense model")  # fmt: skip
    check_divides(_shape(experts[0][1], experts[0][2][0])[0], ranks)
    plans = {(path, n): stack_segments(index, path, n, _shape(m, n))
             for path, m, names in experts for n in names}  # fmt: skip
    _stream(model, Path(model_dir), {"": str(device)}, dtype,
            skip=keys_of(index, (s for segs in plans.values() for s in segs)))  # fmt: skip
    read = [0, 0]
    for path, module, names in experts:
        for name in names:
            _place(module, name, plans[(path, name)], rank, ranks, read, device)
    _finish(model, device)
    model.__dict__[READ] = {"expert_bytes_read": read[0], "expert_stack_bytes": read[1]}
    return model


def _shape(module: nn.Module, name: str) -> tuple[int, ...]:
    return tuple(module._parameters[name].shape)  # type: ignore[union-attr]


def _place(module: nn.Module, name: str, segments: list[Segment], rank: int, ranks: int,
           read: list[int], device: str | torch.device) -> None:  # fmt: skip
    """Read this rank's experts of stack `name`; a full-shape stand-in takes its place."""
    shape = _shape(module, name)
    local = shape[0] // ranks
    dtype = module._parameters[name].dtype  # type: ignore[union-attr]
    mine = torch.empty((local, *shape[1:]), dtype=dtype, device=device)
    read[0] += read_into(expert_part(segments, shape, slice(rank * local, (rank + 1) * local)),
                         mine)  # fmt: skip
    read[1] += sum(s.nbytes for s in segments)
    module.__dict__.setdefault(PART, {})[name] = mine
    stand_in = torch.zeros((), dtype=dtype, device=device).expand(shape)  # no storage
    module._parameters[name] = nn.Parameter(stand_in, requires_grad=False)
