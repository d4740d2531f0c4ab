"""Load once, shard as you go: an FSDP launch holds the base about once per node, not once
per rank.

accelerate's own FSDP2 path does the sharding (`fsdp_cpu_ram_efficient_loading`, which the
launcher turns on for bf16 expert stacks): in `prepare()` it moves the model to the meta
device, shards it with `fully_shard` and broadcasts each tensor of rank 0's full state dict,
every rank keeping its own shard (accelerate's `fsdp2_load_full_state_dict`). So only the
main process needs the weights; here every other rank builds the base on the meta device
(parameters only: buffers such as rotary tables are computed for real, as accelerate
re-registers them), and the LoRA it wraps is meta too – rank 0's seeded factors arrive in
the broadcast. int8 / NF4 expert stacks go the same way: rank 0 quantises as it streams the
checkpoint, the others build the quantised stacks on meta (`meta_quantized`), and on both
the stacks' tensors are frozen Parameters (engine.quant.shardable_: FSDP2 shards Parameters,
never buffers), so each rank keeps its experts' share. Two additions to accelerate's path:

- rank 0 frees each full tensor's storage once it is broadcast (`_Draining`), so the node
  holds one base throughout (rank 0's remainder + every rank's finished shards) instead of
  rank 0's whole copy beside all the shards (measured: dropping only the state dict's
  reference left rank 0 at base + shard – `model.to("meta")` makes new parameters, and the
  old ones, which alias the state dict, are still referenced elsewhere);
- each rank measures its load: the host bytes its model held after loading, the peak of
  live tensor bytes during the broadcast (a dispatch-level byte tracker, DTensors counted by
  their local shard) and its peak RSS; the main process gathers them (`LOAD`), and
  summary.json's "distributed" section records them.

moetune's own reads before training that need the base's values (router snapshot, routing
baseline, expert scores) run on the main process and are broadcast (`from_main`); the LoRA
wrap and the coverage audit read only structure and run on every rank as before.
"""

from __future__ import annotations

import os
import resource
import sys
from collections import Counter
from collections.abc import Callable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from moetune.model.derive import causal_lm_class, ensure_backbone
from moetune.plan.trace.bytes import ByteTracker, Peak

if TYPE_CHECKING:
    from torch import nn

T = TypeVar("T")
LOAD: dict[str, Any] = {}  # this launch's load measurements (every rank's), once gathered
_LOADED: dict[str, int] = {}  # this rank's host bytes of model tensors after load_model


def active() -> bool:
    """A rank of a launch of 2+ processes under accelerate's FSDP with
    cpu_ram_efficient_loading (`accelerate launch` exports both as environment)."""
    env = os.environ
    return (
        env.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        and env.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() == "true"
        and int(env.get("WORLD_SIZE", "1")) > 1
    )


def loads_weights() -> bool:
    """Whether this process reads the base's weights: always, except the non-main ranks of
    a sharded load (they get their shards in prepare())."""
    return not active() or int(os.environ.get("RANK", "0")) == 0


def meta_base(model_id: str, dtype: torch.dtype) -> nn.Module:
    """The causal LM of `model_id` as from_pretrained builds it, with every parameter on the
    meta device (no bytes) and its buffers computed on the CPU."""
    # lazy: heavy to import (accelerate, transformers)
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_id)
    with init_empty_weights(include_buffers=False):
        model = causal_lm_class(config)._from_config(config, dtype=dtype)
    model.eval()  # as from_pretrained leaves it
    return ensure_backbone(model)  # type: ignore[no-any-return]


def meta_quantized(
    model_id: str, experts_dtype: str, dtype: torch.dtype, double_quant: bool
) -> nn.Module:
    """A non-main rank's base with int8 / NF4 expert stacks: `meta_base` with each stack
    replaced by its QuantizedStack of meta tensors – the shapes and dtypes rank 0's quantised
    load holds, none of its bytes (they arrive in prepare(), each rank keeping its shard)."""
    # lazy: heavy to import (moetune's engine, torch)
    from moetune.engine.quant.stacks import quantize_experts_

    model = meta_base(model_id, dtype)
    quantize_experts_(model, experts_dtype, double_quant, error_experts=0)
    return model


def note_loaded(model: nn.Module) -> nn.Module:
    """Record the host bytes the loaded base holds on this rank (meta tensors hold none)."""
    if active():
        _LOADED["loaded_bytes"] = host_bytes(model)
    return model


def materialise_trainable(model: nn.Module) -> nn.Module:
    """Give a meta rank's trainable parameters (the LoRA factors: small) CPU storage of
    zeros. accelerate maps the optimizer's parameters to their shards by data pointer, and
    every meta tensor's is 0; the values are rank 0's, broadcast in prepare()."""
    # lazy: heavy to import (torch)
    from torch import nn

    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.requires_grad and param.is_meta:
                zeros = torch.zeros(param.shape, dtype=param.dtype, device="cpu")
                module._parameters[name] = nn.Parameter(zeros, requires_grad=True)
    return model


def host_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameter and buffer storages that are not on the meta device."""
    return storage_bytes([*model.parameters(), *model.buffers()])


def storage_bytes(tensors: list[Any]) -> int:
    """Bytes of the distinct storages of `tensors` (DTensors: their shard) off the meta device."""
    seen: dict[int, int] = {}
    for tensor in _local(tensors):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def from_main(compute: Callable[[], T]) -> T:
    """`compute()` on the main process, its result on every rank of a sharded load (the
    others hold meta weights); plainly `compute()` anywhere else."""
    if not active():
        return compute()
    # lazy: heavy to import (torch)
    import torch.distributed as dist

    box: list[Any] = [compute() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[no-any-return]


# ---------------------------------------------------------------- accelerate's broadcast


class _Draining(MutableMapping[str, Any]):
    """Rank 0's full state dict, handing each tensor out once and freeing its storage at the
    next read (accelerate reads each key once, broadcasts it and keeps a copied shard). The
    storage itself is freed (`resize_(0)`), not only this dict's reference: the model's old
    parameters, which `model.to("meta")` left to whoever still holds them, alias it. A
    storage two keys share (tied weights) goes once both are read; `close()` frees the last."""

    def __init__(self, source: dict[str, Any]) -> None:
        self.source = source
        self._left = Counter(_storage_key(t) for t in source.values())
        self._sent: list[torch.Tensor] = []

    def __getitem__(self, key: str) -> Any:
        self.close()
        tensor = self.source.pop(key)
        self._left[_storage_key(tensor)] -= 1
        self._sent.append(tensor)
        return tensor

    def close(self) -> None:
        """Free what was sent and is no longer aliased by a key still to come."""
        keep = []
        for tensor in self._sent:
            if self._left[_storage_key(tensor)] > 0:
                keep.append(tensor)
            elif tensor.untyped_storage().resizable():  # an mmap'd file's pages are not
                tensor.untyped_storage().resize_(0)
        self._sent = keep

    def __setitem__(self, key: str, value: Any) -> None:
        self.source[key] = value

    def __delitem__(self, key: str) -> None:
        del self.source[key]

    def __contains__(self, key: object) -> bool:
        return key in self.source

    def __iter__(self) -> Iterator[str]:
        return iter(self.source)

    def __len__(self) -> int:
        return len(self.source)


def _storage_key(tensor: Any) -> int:
    if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
        return id(tensor)
    return int(tensor.untyped_storage().data_ptr())


class LocalBytes(ByteTracker):
    """ByteTracker whose DTensor outputs count by their local shard (a DTensor wrapper has
    no storage of its own)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for tensor in _local(out):
            grew = self._add(tensor.untyped_storage(), "frozen_weights")
            if grew and self.live_bytes > self.peak.bytes:
                self.peak = Peak(self.live_bytes, str(func), "load", 0, self._tick)
        return out


def _local(out: Any) -> list[torch.Tensor]:
    # lazy: heavy to import (torch)
    from torch.distributed.tensor import DTensor

    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _local(item)]
    if isinstance(out, DTensor):
        out = out._local_tensor
    return [out] if isinstance(out, torch.Tensor) and not out.is_meta else []  # meta: no bytes


# ---------------------------------------------------------------- saving


def adapter_only_saves(trainer: Any) -> Any:
    """Make an FSDP trainer's saves (the adapter, every checkpoint) gather only the trainable
    parameters. transformers' FULL_STATE_DICT save gathers the whole model on rank 0 and
    peft then keeps only the LoRA keys – measured: rank 0 peaked at its shard plus the whole
    base at the final save (benchmarks/sharded_load.py). The files written are the same."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        return trainer

    def save_model(output_dir: str | None = None, _internal_call: bool = False) -> None:
        state = gathered_trainable(trainer.model)  # a collective: every rank, same order
        trainer._save(output_dir or trainer.args.output_dir, state_dict=state)

    trainer.save_model = save_model
    return trainer


def gathered_trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter whole on the CPU, by state-dict name (DTensor shards are
    all-gathered; frozen base weights never are)."""
    # lazy: heavy to import (torch)
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            whole = param.full_tensor() if isinstance(param, DTensor) else param
            out[name] = whole.detach().cpu()
    return out


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def install() -> None:
    """Route accelerate's FSDP2 broadcast of rank 0's state dict through `_load`: the same
    call, with the state dict draining and the load measured. Idempotent."""
    # lazy: heavy to import (accelerate)
    from accelerate.utils import fsdp_utils

    original = fsdp_utils.fsdp2_load_full_state_dict
    if getattr(original, "_moetune", False):
        return

    def load(accelerator: Any, model: Any, full_sd: dict[str, Any], *args: Any, **kw: Any) -> Any:
        tracker, draining = LocalBytes(), _Draining(full_sd)
        with tracker:
            out = original(accelerator, model, draining, *args, **kw)
            draining.close()
        _gather(tracker.peak.bytes, host_bytes(out))
        return out

    load._moetune = True  # type: ignore[attr-defined]
    fsdp_utils.fsdp2_load_full_state_dict = load


def _gather(broadcast_peak: int, sharded: int) -> None:
    """Every rank's load figures, gathered on every rank into LOAD (a collective)."""
    # lazy: heavy to import (torch)
    import torch.distributed as dist

    mine = {
        "rank": dist.get_rank(),
        "loaded_bytes": _LOADED.get("loaded_bytes"),
        "broadcast_peak_bytes": broadcast_peak,
        "sharded_bytes": sharded,
        "peak_rss_bytes": peak_rss_bytes(),
    }
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    LOAD.clear()
    LOAD.update(path="rank 0 loads, the others build on meta", ranks=ranks)
