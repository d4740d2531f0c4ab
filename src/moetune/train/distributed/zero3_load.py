"""The base loaded once per node under DeepSpeed ZeRO-3 (`--strategy zero3`).

accelerate's DeepSpeed plugin with `zero3_init_flag` registers its config with transformers
before the model is built, so from_pretrained builds the base under `deepspeed.zero.Init`:
each parameter is partitioned as it is created, and the checkpoint is read on rank 0 alone
(the other ranks map it on the meta device) and scattered one parameter at a time
(transformers' `_load_state_dict_into_zero3_model`). What remains on a rank is its
partition of each parameter (`ds_tensor`) and an empty placeholder in its place.

moetune reads the base before training (router snapshot, routing baseline, expert scores):
those reads run on every rank with one decoder layer's parameters gathered around its
forward and released after it (`gathered_forward`) – the peak is a partition plus one
layer, never the whole base. GatheredParameters is a collective: every rank runs the same
forward passes in the same order (they see the same rows). The LoRA wrap needs no values:
peft sizes its factors from DeepSpeed's `ds_shape`, and the coverage audit counts
`ds_numel`. DeepSpeed's engine converts the (unpartitioned) LoRA parameters in prepare(),
from rank 0's values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from moetune.plan.devices.sharding import zero3_partitioned
from moetune.train.distributed import sharded_load
from moetune.train.routing.recorder import gathered

if TYPE_CHECKING:
    from torch import nn

    from moetune.config import RunConfig
    from moetune.model.spec import ModelSpec

Note = Callable[["nn.Module"], "nn.Module"]  # records the base just loaded, returns it
PATH = "zero.Init: rank 0 reads the checkpoint, every rank keeps its partition"


@contextlib.contextmanager
def base_load(args: Any, cfg: RunConfig, spec: ModelSpec) -> Iterator[Note]:
    """Around the base's load and LoRA wrap. A ZeRO-3 rank (accelerate's DeepSpeed plugin
    on the training args) whose load builds under zero.Init: the load measured, every rank's
    figures gathered into sharded_load.LOAD (a collective) – call the yielded function on
    the loaded base. A ZeRO-3 rank whose load cannot: the DeepSpeed config unregistered from
    transformers meanwhile, so the base is built whole (int8 / NF4 stacks, a published
    quantised or GGUF base, offloaded stacks: moetune's own loaders, plan.sharding's
    zero3_partitioned). Anything else: as it is."""
    plugin = getattr(args, "deepspeed_plugin", None)
    if plugin is None:
        yield _as_is
    elif not zero3_partitioned(spec, cfg):
        with _unregistered(plugin):
            yield _as_is
    else:
        with _measured() as note:
            yield note


def _as_is(model: nn.Module) -> nn.Module:
    return model


@contextlib.contextmanager
def _unregistered(plugin: Any) -> Iterator[None]:
    # lazy: heavy to import (transformers)
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()  # what accelerate registered, back for the trainer


@contextlib.contextmanager
def _measured() -> Iterator[Note]:
    """The live tensor bytes while loading (a dispatch-level tracker: its peak) and the
    host bytes the base holds once loaded; published on every rank at the end."""
    tracker, loaded = sharded_load.LocalBytes(), {}

    def note(model: nn.Module) -> nn.Module:
        loaded["bytes"] = held_bytes(model)
        return model

    with tracker:
        yield note
    _publish(loaded.get("bytes"), tracker.peak.bytes)


def held_bytes(model: nn.Module) -> int:
    """Host bytes of the model on this rank: each ZeRO-3 parameter's partition, every
    other parameter and buffer whole (the placeholders of partitioned ones hold none)."""
    params = [p.ds_tensor if partitioned(p) else p for p in model.parameters()]  # type: ignore[attr-defined]
    return sharded_load.storage_bytes([*params, *model.buffers()])


def _publish(loaded: int | None, peak: int) -> None:
    """Every rank's load figures, gathered on every rank into sharded_load.LOAD."""
    # lazy: heavy to import (torch)
    import torch.distributed as dist

    mine = {
        "rank": dist.get_rank(),
        "loaded_bytes": loaded,
        "load_peak_bytes": peak,
        "peak_rss_bytes": sharded_load.peak_rss_bytes(),
    }
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    sharded_load.LOAD.clear()
    sharded_load.LOAD.update(path=PATH, ranks=ranks)


def partitioned(param: Any) -> bool:
    """A ZeRO-3 parameter (it carries DeepSpeed's id; its data is a placeholder)."""
    return hasattr(param, "ds_id")


def _units(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    """The modules gathered around their own forward, with whether their children's
    parameters come too: each decoder layer whole (a wrapper such as peft's ParamWrapper
    reads its base's parameter in its own forward, not the base's), and each module outside
    the layers that owns ZeRO-3 parameters directly (embeddings, final norm, head)."""
    layers = {name for m in model.modules() for name in getattr(m, "_no_split_modules", None) or []}
    units: list[tuple[nn.Module, bool]] = []
    inside: set[int] = set()
    for module in model.modules():  # pre-order: a layer comes before what it holds
        if id(module) in inside:
            continue
        if type(module).__name__ in layers:
            units.append((module, True))
            inside.update(id(m) for m in module.modules())
        elif any(map(partitioned, module.parameters(recurse=False))):
            units.append((module, False))
    return units


@contextlib.contextmanager
def gathered_forward(model: nn.Module) -> Iterator[None]:
    """Forward passes of `model` inside see its ZeRO-3 parameters whole one decoder layer
    (or one module outside the layers) at a time: gathered in its forward pre-hook, released
    in its forward hook. A model without ZeRO-3 parameters runs as it is."""
    units = _units(model) if any(map(partitioned, model.parameters())) else []
    if not units:
        yield
        return
    opened: list[Any] = []  # the contexts now open, innermost last

    def hook(whole: bool) -> Callable[[nn.Module, Any], None]:
        def gather(module: nn.Module, args: Any) -> None:
            opened.append(gathered(list(module.parameters(recurse=whole))))
            opened[-1].__enter__()

        return gather

    def release(module: nn.Module, args: Any, out: Any) -> None:
        opened.pop().__exit__(None, None, None)

    handles = [m.register_forward_pre_hook(hook(whole)) for m, whole in units]
    handles += [m.register_forward_hook(release) for m, _ in units]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        while opened:  # a forward that raised: release what it had gathered
            opened.pop().__exit__(None, None, None)
