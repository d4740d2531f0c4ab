"""train.ep_degree: a parameter no rank's backward reached steps as on one process – not at all.

Every rank of an FSDP2 unit must join the same reduce-scatter, so `shard_rest` has FSDP2
put a zero in for a parameter this rank's backward left without a gradient
(`set_reduce_scatter_unused_params`). Where another rank's backward reached it, that zero is
what one process's gradient holds for this rank's rows. Where NO rank's did – an expert
selection that keeps none of a layer's experts, so no rank runs that layer's expert LoRA –
one process's gradient is None: AdamW skips the factor (no weight decay, no step counted),
while the reduce-scatter's zero would decay it. So each rank records which parameters its
backward reached (a hook on FSDP2's unsharded parameter, the one autograd accumulates into),
and before each optimizer step one all-reduce of those flags (ep_lora.ranks_with, as the
sliced factors' fill uses it) sets the gradient of a parameter no rank reached back to None.
A step with no forward since the last one is left alone: torch's own optimizer-state load
(`set_optimizer_state_dict`, how `--resume` restores FSDP2's state) steps once with zero
gradients and lr 0 to create the state it fills, and every rank makes that step alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

REACHED = "_moetune_reached"  # model.__dict__: the names this rank's backward reached
FORWARD = ""  # in that set: a forward ran since the last step (no parameter has this name)


def track_reached(model: nn.Module, units: list[nn.Module]) -> None:
    """Record, until the next optimizer step, the parameters this rank's backward reached.
    `units`: the modules `fully_shard` wrapped (model's own among them); each forward
    registers their unsharded parameters, and a hook on each (once) notes its name."""
    # lazy: heavy to import (DTensor; the trainer imports this module at its top)
    from torch.distributed.tensor import DTensor

    reached: set[str] = set()
    hooked: set[int] = set()
    prefixes = {id(m): name for name, m in model.named_modules()}

    def note(name: str) -> Any:
        return lambda _param: reached.add(name)

    def pre_forward(unit: nn.Module, _args: Any) -> None:
        reached.add(FORWARD)
        prefix = prefixes[id(unit)]
        for name, param in unit.named_parameters(prefix=prefix):
            # FSDP2's own pre-forward hook ran first (prepended): this unit's parameters
            # are its unsharded ones now, plain tensors (the sharded ones are DTensors)
            if param.requires_grad and not isinstance(param, DTensor) and id(param) not in hooked:
                hooked.add(id(param))
                param.register_post_accumulate_grad_hook(note(name))

    for unit in units:
        unit.register_forward_pre_hook(pre_forward)
    model.__dict__[REACHED] = reached


def drop_unreached_before_step(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Before each step of `optimizer`: a sharded parameter no rank's backward reached gets
    its gradient (FSDP2's reduce-scattered zero) set back to None. A no-op for a model
    `track_reached` did not see. A collective over every rank (FSDP2's flattened mesh)."""
    reached: set[str] | None = model.__dict__.get(REACHED)
    if reached is None:
        return
    # lazy: heavy to import (moetune's engine pulls transformers and peft; DTensor)
    from torch.distributed.tensor import DTensor

    from moetune.engine.ep_lora import ranks_with

    sharded = [(n, p) for n, p in model.named_parameters() if isinstance(p, DTensor)]
    sharded = [(n, p) for n, p in sharded if p.requires_grad]

    def hook(_opt: torch.optim.Optimizer, *_args: Any) -> None:
        if FORWARD not in reached:  # torch's state-creating step at a load, not training's
            return
        got = ranks_with([n in reached for n, _ in sharded], None, sharded[0][1].device)
        for (_name, param), ranks in zip(sharded, got, strict=True):
            if not ranks:
                param.grad = None
        reached.clear()

    if sharded:
        optimizer.register_step_pre_hook(hook)


def unreached_trainer(trainer: Any) -> Any:
    """Install `drop_unreached_before_step` on the optimizer the Trainer creates (a no-op
    for a model `track_reached` did not see). Returns the trainer."""
    if REACHED not in trainer.model.__dict__:
        return trainer
    create = trainer.create_optimizer

    def create_optimizer(*args: Any, **kwargs: Any) -> Any:
        optimizer = create(*args, **kwargs)
        drop_unreached_before_step(optimizer, trainer.model)
        return optimizer

    trainer.create_optimizer = create_optimizer
    return trainer
