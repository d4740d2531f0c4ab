"""A trainer whose experts' LoRA each rank holds only in part (train.strategy ep,
engine/ep_lora.py): what transformers' Trainer does with its parameters, made whole.

- **Clipping** takes the norm of the whole gradient (every rank's sliced part added), so
  every rank clips by the same factor – per rank, the replicated LoRA would drift apart.
- **Saving** (the adapter and every checkpoint's) gathers each sliced factor on every rank,
  and rank 0 writes the whole adapter in peft's layout – the files one process writes.
- **The optimizer state** in a checkpoint is whole too: the moments of a sliced factor are
  gathered like the factor (optimizer.pt is one process's), and cut back to this rank's
  slice when `--resume` loads it – with the checkpoint's adapter, cut the same way.
- **Every step** first gives a slice no token reached on this rank a zero gradient where
  another rank's slice got one (ep_lora.fill_missing_grads, a step pre-hook on the optimizer
  the Trainer creates), so every rank holds AdamW state for the same factors; a checkpoint
  where they differ is refused rather than left waiting in the gather.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from moetune.train.errors import TrainError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from torch import nn


def ep_trainer(trainer: Any) -> Any:
    """Install the whole-making saves, loads and clipping on a trainer whose model holds
    sliced expert LoRA (a no-op otherwise). Returns the trainer."""
    # lazy: heavy to import (moetune's engine pulls transformers and peft)
    from moetune.engine.ep_lora import ep_group, fill_before_step

    group = ep_group(trainer.model)
    if group is None:
        return trainer
    save_optimizer = trainer._save_optimizer_and_scheduler
    load_optimizer = trainer._load_optimizer_and_scheduler

    def save_model(output_dir: str | None = None, _internal_call: bool = False) -> None:
        state = whole_trainable(trainer.model)  # a collective: every rank, same order
        if trainer.args.should_save:
            trainer._save(output_dir or trainer.args.output_dir, state_dict=state)

    def save_state(output_dir: str) -> None:
        state = whole_optimizer_state(trainer.optimizer)  # a collective too
        with _answering(trainer.optimizer, "state_dict", lambda: state):
            save_optimizer(output_dir)

    def load_state(checkpoint: str | None) -> None:
        optimizer = trainer.optimizer
        load = optimizer.load_state_dict
        with _answering(optimizer, "load_state_dict", lambda sd: load(cut_state(optimizer, sd))):
            load_optimizer(checkpoint)

    def create_optimizer(*args: Any, **kwargs: Any) -> Any:
        optimizer = create(*args, **kwargs)
        fill_before_step(optimizer, group)  # a slice no token reached steps as on one process
        return optimizer

    create = trainer.create_optimizer
    trainer.create_optimizer = create_optimizer
    trainer.save_model, trainer._save_optimizer_and_scheduler = save_model, save_state
    trainer._load_optimizer_and_scheduler = load_state
    trainer._load_from_checkpoint = lambda path, model=None: load_adapter(trainer.model, path)
    trainer._clip_grad_norm = lambda model: clip(trainer, group)
    return trainer


@contextmanager
def _answering(obj: Any, name: str, method: Callable[..., Any]) -> Iterator[None]:
    """`obj.name` is `method` inside the block (an instance attribute over the class's)."""
    setattr(obj, name, method)
    try:
        yield
    finally:
        delattr(obj, name)


def _pieces(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, Any]]:
    """(name, parameter, its Piece or None) of every trainable parameter."""
    # lazy: heavy to import (moetune's engine)
    from moetune.engine.ep_lora import piece_of

    for name, param in model.named_parameters():
        if param.requires_grad:
            yield name, param, piece_of(param)


def whole_trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter whole on the CPU by state-dict name, sliced ones gathered."""
    # lazy: heavy to import (moetune's engine)
    from moetune.engine.ep_lora import whole

    return {
        name: (param if piece is None else whole(param, piece)).detach().cpu()
        for name, param, piece in _pieces(model)
    }


def _optimized(optimizer: Any) -> list[torch.Tensor]:
    """The parameters in the numbering of torch's optimizer state dict (groups in order)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def whole_optimizer_state(optimizer: Any) -> dict[str, Any]:
    """The optimizer's state dict with every sliced factor's moments gathered whole (every
    rank calls it: a collective)."""
    # lazy: heavy to import (moetune's engine)
    from moetune.engine.ep_lora import piece_of, whole

    state = optimizer.state_dict()  # its per-parameter dicts are the live ones: not edited
    _require_state_everywhere(optimizer, state["state"])
    for index, param in enumerate(_optimized(optimizer)):
        piece, held = piece_of(param), state["state"].get(index)
        if piece is not None and held is not None:
            state["state"][index] = {
                key: whole(v, piece).cpu() if torch.is_tensor(v) and v.shape == param.shape else v
                for key, v in held.items()
            }
    return state


def _require_state_everywhere(optimizer: Any, state: dict[int, Any]) -> None:
    """Each sliced factor has optimizer state on every rank of its group or on none (else the
    gather would wait for a rank that has nothing to send): one all-reduce, then a refusal
    rather than a hang or a checkpoint with some experts' moments missing."""
    # lazy: heavy to import (moetune's engine)
    from moetune.engine.ep_lora import piece_of, ranks_with

    params = _optimized(optimizer)
    sliced = [i for i, p in enumerate(params) if piece_of(p) is not None]
    if not sliced:
        return
    shard = piece_of(params[sliced[0]]).shard  # type: ignore[union-attr]
    has = ranks_with([i in state for i in sliced], shard.group, params[sliced[0]].device)
    if any(0 < n < shard.ranks for n in has):
        raise TrainError(
            "some ranks hold optimizer state for an expert LoRA slice and others none, so the "
            "checkpoint cannot hold it whole",
            "step the optimizer with ep_lora.fill_before_step installed (ep_trainer does)",
        )


def cut_state(optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
    """A whole optimizer state dict with each sliced factor's moments cut to this rank's
    slice; a moment of another shape is refused, not loaded into the wrong experts."""
    # lazy: heavy to import (moetune's engine)
    from moetune.engine.ep_lora import piece_of

    kept = dict(state["state"])  # the given dict is left as it was
    for index, param in enumerate(_optimized(optimizer)):
        piece, held = piece_of(param), kept.get(index)
        if piece is not None and held is not None:
            kept[index] = {key: _cut_moment(v, piece, param, key) for key, v in held.items()}
    return {**state, "state": kept}


def _cut_moment(value: Any, piece: Any, param: torch.Tensor, key: str) -> Any:
    """One state entry of a sliced factor: a moment cut to this rank's slice (the step
    count as it is)."""
    # lazy: heavy to import (moetune's engine)
    from moetune.engine.ep_lora import part_of

    if not torch.is_tensor(value) or value.dim() == 0:
        return value
    _require_whole(value.shape, piece.whole_shape(param.shape), f"optimizer {key}")
    return part_of(value, piece)


def _require_whole(got: torch.Size, want: tuple[int, ...], what: str) -> None:
    if tuple(got) != want:
        raise TrainError(
            f"the checkpoint's {what} of an expert LoRA factor is {tuple(got)}, not the whole "
            f"{want} this run slices",
            "resume with the config that saved it (same model, lora.r and targets)",
        )


def load_adapter(model: nn.Module, checkpoint: str) -> None:
    """The checkpoint's adapter (whole, peft's layout) into the model, each sliced factor
    cut to this rank's slice; a parameter it lacks is refused."""
    # lazy: heavy to import (peft, moetune's engine)
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    from moetune.engine.ep_lora import part_of

    saved = load_peft_weights(checkpoint, device="cpu")
    adapter = getattr(model, "active_adapter", "default")
    for name, param, piece in _pieces(model):
        key = name.replace(f".{adapter}.", ".")  # peft saves without the adapter's name
        if key not in saved:
            raise TrainError(
                f"the checkpoint {checkpoint} holds no {key}",
                "resume with the config that saved it (same model and targets)",
            )
        if piece is not None:
            _require_whole(saved[key].shape, piece.whole_shape(param.shape), key)
            saved[key] = part_of(saved[key], piece)
    set_peft_model_state_dict(model, saved, adapter_name=adapter)


def clip(trainer: Any, group: Any) -> torch.Tensor:
    """Clip to train's max_grad_norm by the whole gradient's norm; returns it (pre-clip)."""
    # lazy: heavy to import (moetune's engine)
    from torch.nn.utils import clip_grads_with_norm_

    from moetune.engine.ep_lora import grad_norm

    trainer.accelerator.unscale_gradients()  # fp16's loss scale, as accelerate's clip does
    params = [p for p in trainer.model.parameters() if p.grad is not None]
    norm = grad_norm(params, group)
    clip_grads_with_norm_(params, trainer.args.max_grad_norm, norm)
    return norm
