"""The mode a measurement forward runs in, and leaving the model exactly as it was.

A routing measurement (the base's routing before the first step, expert selection's
scores) wants no dropout and no router jitter, so it runs the model's modules in eval
mode – but a module whose kernel depends on its mode must not see eval: bitsandbytes 0.50's
`Linear4bit` on a CPU with AVX512-BF16 repacks its weight for an inference kernel on the
first eval forward without grad, for good, and from then on passes no input gradient
(docs/knowledge.md §14). Such modules store their weight as integers and hold no dropout,
so `measuring` runs every module with an integer weight (bitsandbytes' 4-bit / 8-bit,
moetune's own int8 / NF4 stacks) in the mode it trains in – train mode: the trainer puts
the whole model in train mode every step, and a model fresh from `from_pretrained` is in
eval – and afterwards gives every module back its own `training` flag (not a blanket
`model.train()` / `eval()`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def stores_integers(module: nn.Module) -> bool:
    """Whether `module` itself holds a weight stored as integers (a quantised kernel)."""
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    # a 0-dim integer is a counter (batch norm's num_batches_tracked), not a weight
    return any(not (t.is_floating_point() or t.is_complex()) for t in tensors if t.numel() > 1)


@contextlib.contextmanager
def measuring(model: nn.Module) -> Iterator[None]:
    """No grad, eval mode for every module of `model` but the quantised kernels, which run
    in train mode; each module's own training flag back on exit."""
    modes = [(module, module.training) for module in model.modules()]
    try:
        for module, _ in modes:
            module.training = stores_integers(module)
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training
