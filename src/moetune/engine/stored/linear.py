"""A frozen Linear kept in a published format's bytes (DeepSeek's FP8 attention, dense and
shared MLP): the forward dequantises its weight for the call and the backward again for the
exact input gradient, so no float copy is kept. It is the `nn.Linear` peft wraps (LoRA on
top, through peft); `weight` is a zero-storage stand-in of the float weight's shape, dtype and
device, which is all peft reads of it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moetune.engine.quant.stacks import QUANTIZERS, QuantError, QuantizedStack, _DequantLinear
from moetune.engine.stored.formats import StoredFormat, kept_float, published_quantised


def _stand_in(stack: QuantizedStack) -> nn.Parameter:
    empty = torch.zeros((), dtype=stack.dtype, device=stack.device).expand(stack.out_in)
    return nn.Parameter(empty, requires_grad=False)


class StoredLinear(nn.Linear):
    """y = x·Wᵀ + b with W in its stored bytes (`stored`, a one-"expert" QuantizedStack)."""

    def __init__(self, stored: QuantizedStack, bias: torch.Tensor | None) -> None:
        nn.Module.__init__(self)
        self.out_features, self.in_features = stored.out_in
        self.stored = stored
        self.weight = _stand_in(stored)
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias, False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = _DequantLinear.apply(x, self.stored, 0)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantized(self) -> nn.Linear:
        """A plain Linear with the float weight (the merged export, dequantised bases)."""
        with torch.device("meta"):
            plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        plain.weight = nn.Parameter(self.stored.expert(0), requires_grad=False)
        if self.bias is not None:
            plain.bias = self.bias
        return plain

    def _apply(self, fn: Any, recurse: bool = True) -> StoredLinear:
        # Module.to would materialise the stand-in; move the stored bytes (exact) and the
        # bias, and give the stand-in the new dtype / device
        self.stored._apply(fn)
        if self.bias is not None:
            self.bias = nn.Parameter(fn(self.bias.data), requires_grad=False)
        self.weight = _stand_in(self.stored)
        return self

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        # the stand-in holds no values: the state dict has the bias and (child) stored buffers
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, stored={self.stored.backend.name}"


def replace_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    model.get_submodule(parent).add_module(leaf, module)


def dequantize_linears_(model: nn.Module) -> int:
    """Every StoredLinear back to a plain frozen Linear in place; how many."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, StoredLinear)]
    for path, module in found:
        replace_module(model, path, module.dequantized())
    return len(found)


def store_float_linears_(model: nn.Module, method: str, options: dict[str, Any],
                         qcfg: dict[str, Any] | None = None) -> int:  # fmt: skip
    """The Linears a publisher of `method` quantises – but for those `qcfg`'s lists keep float
    (kept_float) – replaced by StoredLinears quantised from their float weights (the planner's
    trace builds a stored base so, on meta); how many."""
    fmt = QUANTIZERS.get(method).configured(**options)
    if not (issubclass(fmt, StoredFormat) and not fmt.experts_only):
        return 0
    done = 0
    for path, module in list(model.named_modules()):
        if type(module) is not nn.Linear or not published_quantised(path):
            continue
        if kept_float(qcfg or {}, path):
            continue  # the checkpoint's ignore / exclude list: float, as published
        try:
            bufs = fmt.quantize(module.weight.detach()[None], **options)
        except QuantError:
            continue  # blocks that do not divide it: float, as published
        stack = QuantizedStack((1, *module.weight.shape), False, module.weight.dtype, fmt, bufs)  # type: ignore[arg-type]
        replace_module(model, path, StoredLinear(stack, module.bias))
        done += 1
    return done
