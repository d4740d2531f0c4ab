"""dbrx's routed experts with peft's LoRA really applied (the override for "dbrx").

transformers' `DbrxExperts.forward` reads the 2-D stacks `mlp.w1`, `mlp.v1`, `mlp.w2`
([E·I, H]; expert e's rows e·I … (e+1)·I) itself and hands one expert's slices to
`mlp(...)`. Through peft's nested ParamWrappers that read fails ("'ParamWrapper' object
has no attribute 'v1'"), and the slices would be the frozen weights anyway: peft adds ΔW
only inside the wrapper's own forward.

Here the same experts compute from the same parameters, split like moetune's engine
(experts_lora): the routed (token, slot) pairs, sorted by expert, go through the frozen
stack with grouped matmuls and each adapter adds its update, with no W-sized tensor.
peft 0.21's layout for a 2-D parameter (ParamWrapper with num_experts 1, i.e.
`lora.Linear.get_delta_weight`): `lora_A` [r, H], `lora_B` [E·I, r], ΔW = s·B·A with
s = alpha/r (alpha/√r with rslora) – one A shared by every expert, expert e's rows of B:

    w1, v1 (x·W_eᵀ):   x·(W_e + s·B_e·A)ᵀ = x·W_eᵀ + s·(x·Aᵀ)·B_eᵀ
    w2     (h·W_e):    h·(W_e + s·B_e·A)  = h·W_e  + s·(h·B_e)·A

and out_e = (act(x·w1_eᵀ) * x·v1_eᵀ)·w2_e, as `DbrxExpertGLU` computes it. There is no
`nonzero` (transformers' loop has one), so the planner traces it on fake tensors too.
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.lora.layer import ParamWrapper
from torch import nn

from moetune.engine.experts_lora import (
    Combine,
    Dispatch,
    Routing,
    grouped_mm,
    pad_rank,
    route_pairs,
)
from moetune.engine.forwards import register_override

# DbrxExpertGLU computes x·w1ᵀ and x·v1ᵀ (a stack's rows are outputs) but h·w2 (inputs)
_ROWS_ARE_OUTPUTS = {"w1": True, "v1": True, "w2": False}
_LORA = "_moetune_dbrx_lora"  # class flag: already the LoRA-applying subclass


@register_override("dbrx")
def apply_dbrx_lora(model: nn.Module) -> int:
    """Give every DbrxExperts module the forward that applies its LoRA; returns how many."""
    # lazy: heavy to import (transformers)
    from transformers.models.dbrx.modeling_dbrx import DbrxExperts

    experts: list[nn.Module] = [m for m in model.modules() if isinstance(m, DbrxExperts)]
    for module in experts:
        module.__class__ = _with_lora(type(module))
    return len(experts)


def _with_lora(cls: type) -> type:
    """A subclass with only `forward` replaced: parameters and state dict stay transformers'."""
    if getattr(cls, _LORA, False):
        return cls
    if cls not in _SUBCLASSES:  # one per class, so every layer's module has the same type
        body = {"forward": lora_experts_forward, _LORA: True}
        _SUBCLASSES[cls] = type(f"Lora{cls.__name__}", (cls,), body)
    return _SUBCLASSES[cls]


_SUBCLASSES: dict[type, type] = {}


def lora_experts_forward(
    self: Any,  # a DbrxExperts (dynamic attributes)
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """`DbrxExperts.forward` with every active adapter's ΔW on the routed experts."""
    glu, wrappers = _unwrap(self.mlp)
    top_k = top_k_index.shape[-1]
    route = route_pairs(top_k_index, top_k_weights, self.num_experts)
    flat = hidden_states.reshape(-1, self.hidden_size)
    x = Dispatch.apply(flat, route.perm, route.inverse, top_k)
    gate = glu.activation_fn(_project(glu, wrappers.get("w1"), "w1", x, route))
    up = _project(glu, wrappers.get("v1"), "v1", x, route)
    out = _project(glu, wrappers.get("w2"), "w2", gate * up, route)
    out = out * route.weights.unsqueeze(-1)
    summed = Combine.apply(out, route.perm, route.inverse, top_k)
    return summed.view(hidden_states.shape[0], -1, self.hidden_size).to(hidden_states.dtype)


def _unwrap(module: nn.Module) -> tuple[Any, dict[str, ParamWrapper]]:
    """The DbrxExpertGLU under peft's nested wrappers, and each wrapper by parameter name."""
    wrappers: dict[str, ParamWrapper] = {}
    while isinstance(module, ParamWrapper):
        wrappers[module.parameter_name] = module
        module = module.base_layer
    return module, wrappers


def _project(
    glu: Any, wrapper: ParamWrapper | None, name: str, x: torch.Tensor, route: Routing
) -> torch.Tensor:
    """Rows sorted by expert through their expert's slice of stack `name`, plus LoRA."""
    stack = getattr(glu, name)
    stack = stack.view(route.offsets.numel(), -1, stack.shape[-1])  # (E, I, H)
    rows_out = _ROWS_ARE_OUTPUTS[name]
    x = x.to(stack.dtype)
    out = grouped_mm(x, stack.transpose(1, 2) if rows_out else stack, route.offsets)
    for first, second, dropout in _factors(wrapper, stack.shape[0], rows_out, x.dtype):
        low = _matmul(dropout(x), first, route.offsets)
        # in place: grouped_mm's backward does not need its output
        out.add_(_matmul(low, second, route.offsets))
    return out


def _factors(
    wrapper: ParamWrapper | None, experts: int, rows_out: bool, dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor, nn.Module]]:
    """Each active adapter's (first, second, dropout): x·first·second is its update; the
    per-expert factor is an (E, ·, ·) stack, the shared one a matrix (module docstring)."""
    if wrapper is None or wrapper.merged or wrapper.disable_adapters:
        if wrapper is not None and wrapper.merged and wrapper.disable_adapters:
            wrapper.unmerge()  # what peft's own forward does with adapters turned off
        return []
    found = []
    for adapter in [a for a in wrapper.active_adapters if a in wrapper.lora_A]:
        a = _weight(wrapper.lora_A, adapter).to(dtype)  # [r, H]
        b = (_weight(wrapper.lora_B, adapter) * wrapper.scaling[adapter]).to(dtype)  # [E·I, r]
        b = b.view(experts, -1, b.shape[-1])  # (E, I, r): expert e's rows
        first, second = (a.T, b.transpose(1, 2)) if rows_out else (b, a)
        found.append((*pad_rank(first, second), wrapper.lora_dropout[adapter]))
    return found


def _weight(layers: nn.ModuleDict, adapter: str) -> torch.Tensor:
    weight = layers[adapter].weight
    assert isinstance(weight, torch.Tensor)
    return weight


def _matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x by a shared matrix, or row by row by its expert's matrix of a stack."""
    return x @ w if w.dim() == 2 else grouped_mm(x, w.contiguous(), offsets)
