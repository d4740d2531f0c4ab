"""Split LoRA for fused MoE experts, served through transformers' `ExpertsInterface`.

peft's `ParamWrapper` adapts a fused expert stack by materialising W + s·B·A for every
expert on every forward (and a full-size weight gradient in backward), whatever the
routing, and it refuses dropout. Here each expert's routed tokens go through the frozen
base weight and, separately, through that expert's rank-r factors:

    y_e = x_e·W_eᵀ + s·(dropout(x_e)·A_eᵀ)·B_eᵀ

so nothing the size of an expert stack is allocated, and only A and B get gradients.
On quantised experts (engine/quant/stacks.py) W_e is dequantised one expert at a time, in
forward and again in backward, so no float stack exists at all.

The factors stay where peft keeps them (the wrappers' `lora_A` / `lora_B`), so
`save_pretrained` writes a standard peft adapter that loads with plain
`PeftModel.from_pretrained`. `apply_split_lora` switches a peft model over:

* "moetune_lora" is registered in `ALL_EXPERTS_FUNCTIONS` and selected with
  `set_experts_implementation`, so every family decorated with
  `@use_experts_implementation` dispatches here (is_transposed, has_bias, has_gate,
  post-expert norm and the family's own `_apply_gate` are honoured like the stock paths);
* each experts module gets a map parameter name -> its wrapper, read on every call, so
  peft's adapter switching, `disable_adapter()` and merging keep working;
* each wrapper becomes a `SplitParamWrapper`, whose forward no longer parametrizes the
  weight (the experts forward applies the factors instead);
* `train_only` limits the LoRA compute to some experts (expert selection, train/routing/select.py).

peft's layout (0.21, `ParamWrapper.get_delta_factors`), E experts, rank r per expert:
`lora_A.weight` is [r·E, in] = (E, r, in), expert-major, but `lora_B.weight` is
[out, r·E] = (out, r, E) with the expert index fastest; scaling is alpha/r (alpha/√r with
rslora). in/out are the projection's sizes whether the stack is [E, out, in] or
transposed [E, in, out].
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import ParamWrapper
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.modules.module import register_module_module_registration_hook
from torch.utils.hooks import RemovableHandle
from transformers.integrations.moe import ExpertsInterface

from moetune.engine.offload.store import StackRef, offloaded_of
from moetune.engine.quant.stacks import QuantizedStack, stacks_of
from moetune.errors import MoetuneError

IMPLEMENTATION = "moetune_lora"
PROJECTIONS = ("gate_up_proj", "up_proj", "down_proj")
_STATE = "_moetune_lora"  # on an experts module: {parameter name: its SplitParamWrapper}
_PREVIOUS = "_moetune_previous_experts"  # on the base model: implementation to restore
_KEEP = "_moetune_trained_experts"  # on an experts module: bool [E], experts whose LoRA runs


class EngineError(MoetuneError):
    """The split-LoRA engine cannot run on this model as asked."""


@dataclass(frozen=True)
class Routing:
    """(token, slot) pairs sorted by expert, as grouped kernels want them."""

    ids: torch.Tensor  # expert id of each sorted pair
    perm: torch.Tensor  # sorted position -> flat (token, slot) index
    inverse: torch.Tensor  # flat (token, slot) index -> sorted position
    offsets: torch.Tensor  # int32 end row of each expert's group
    weights: torch.Tensor  # routing weight of each sorted pair


@dataclass(frozen=True)
class _Factors:
    """One adapter's factors for one projection, shaped for grouped matmuls."""

    a: torch.Tensor  # (E, in, r)
    b: torch.Tensor  # (E, r, out), scaling folded in
    dropout: nn.Module


def split_lora_experts_forward(
    self: Any,  # an experts module decorated by @use_experts_implementation (dynamic attrs)
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The experts forward registered as "moetune_lora" (same contract as grouped_mm)."""
    if getattr(self, "_is_expert_parallel", False):
        raise EngineError(
            "split LoRA does not support expert parallelism.",
            "train without expert parallelism, or use peft's stock path (restore_peft_lora).",
        )
    num_tokens, hidden_dim = hidden_states.shape
    top_k = top_k_index.size(-1)
    route = route_pairs(top_k_index, top_k_weights, self.num_experts)
    x = Dispatch.apply(hidden_states, route.perm, route.inverse, top_k)
    h = _project(self, "gate_up_proj" if self.has_gate else "up_proj", x, route)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    out = _project(self, "down_proj", h, route)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    out = out * route.weights.unsqueeze(-1)
    summed = Combine.apply(out, route.perm, route.inverse, top_k)
    return summed.view(num_tokens, hidden_dim).to(hidden_states.dtype)


def route_pairs(
    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int
) -> Routing:
    # stable: an expert's rows in token order, the order expert parallelism receives them in
    # (rank after rank), so both sum an expert's gradient alike (train/distributed/ep_padding.py)
    ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)
    # histc, not bincount: a fixed output shape, so fake-tensor traces work too
    counts_of = ids.float() if ids.device.type in ("cpu", "mps") else ids.int()
    counts = torch.histc(counts_of, bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return Routing(ids, perm, inverse, offsets, top_k_weights.reshape(-1)[perm])


class Dispatch(torch.autograd.Function):
    """Token rows -> (token, slot) pairs in expert order.

    Autograd would scatter-add the gradient back (`index_put_` with accumulate: slow and
    serial on CPU); knowing the index is a permutation of repeated rows, it is a gather
    and a sum over the k slots instead.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor,
                top_k: int) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return hidden[perm // top_k]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (inverse,) = ctx.saved_tensors
        summed = grad[inverse].view(-1, ctx.top_k, grad.shape[-1]).sum(dim=1)
        return summed, None, None, None


class Combine(torch.autograd.Function):
    """Pairs in expert order -> per-token sums; both directions are gathers (see Dispatch)."""

    @staticmethod
    def forward(ctx: Any, pairs: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor,
                top_k: int) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(perm)
        ctx.top_k = top_k
        # reshape+sum like the stock paths: deterministic, and accumulates in fp32
        return pairs[inverse].view(-1, top_k, pairs.shape[-1]).sum(dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (perm,) = ctx.saved_tensors
        return grad[perm // ctx.top_k], None, None, None


def _project(
    experts: Any, name: str, x: torch.Tensor, route: Routing, part: slice = slice(None)
) -> torch.Tensor:
    """Base projection of each row by its own expert, plus each active adapter's update;
    `part`: the experts the module holds (expert parallelism: route.ids count from its start)."""
    quantized = stacks_of(experts).get(name)
    streamed = offloaded_of(experts).get(name)
    if streamed is not None:  # offloaded (engine/offload/store.py): fetched, never saved
        x = x.to(streamed.dtype)
        out: torch.Tensor = _StreamedGroupedLinear.apply(x, streamed, route.offsets)
    elif quantized is not None:  # never read the attribute: it would dequantise the stack
        x = x.to(quantized.dtype)
        out = _QuantizedGroupedLinear.apply(x, quantized, route.offsets)
    else:
        weight = getattr(experts, name)
        x = x.to(weight.dtype)
        stack = weight if experts.is_transposed else weight.transpose(-2, -1)
        out = grouped_mm(x, stack, route.offsets)
    # in place: grouped_mm's backward does not need its output, so this saves a copy
    if experts.has_bias:
        out.add_(getattr(experts, f"{name}_bias")[route.ids])
    keep = experts.__dict__.get(_KEEP)
    keep = None if keep is None else keep[part]
    for factors in _active_factors(experts, name, x.dtype, part):
        if keep is None:
            low = grouped_mm(factors.dropout(x), factors.a, route.offsets)
            out.add_(grouped_mm(low, factors.b, route.offsets))
        else:
            _add_kept_lora(out, x, factors, route, keep)
    return out


def _add_kept_lora(
    out: torch.Tensor, x: torch.Tensor, factors: _Factors, route: Routing, keep: torch.Tensor
) -> None:
    """The LoRA update of the rows routed to the experts `keep` marks; the others get none
    (exact while their ΔW is zero, which train/routing/select.py asserts and keeps so)."""
    keep = keep.to(x.device)
    if not bool(keep.any()):  # none of these trains (under ep, a rank may hold none kept)
        return
    rows = keep[route.ids].nonzero().squeeze(1)  # still grouped by expert: ids are sorted
    counts = torch.diff(route.offsets, prepend=route.offsets.new_zeros(1))
    offsets = torch.cumsum(counts[keep], dim=0, dtype=torch.int32)
    low = grouped_mm(factors.dropout(x[rows]), factors.a[keep], offsets)
    out.index_add_(0, rows, grouped_mm(low, factors.b[keep], offsets).to(out.dtype))


def _active_factors(
    experts: nn.Module, name: str, dtype: torch.dtype, part: slice = slice(None)
) -> list[_Factors]:
    wrapper = getattr(experts, _STATE, {}).get(name)
    if wrapper is None or wrapper.disable_adapters or wrapper.merged:
        return []  # no LoRA here, adapters off, or already folded into the weight
    adapters = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
    return [_factors(wrapper, adapter, dtype, part) for adapter in adapters]


def _factors(wrapper: Any, adapter: str, dtype: torch.dtype, part: slice) -> _Factors:
    """Read peft's factors as grouped-matmul operands (layout in the module docstring)."""
    a = wrapper.lora_A[adapter].weight  # [r·E, in]
    b = wrapper.lora_B[adapter].weight  # [out, r·E]
    # expert parallelism may hold only `part`'s factors (engine/ep_lora.py): then they are all
    held = a.shape[0] // wrapper.r[adapter]
    mine = part if held == wrapper.num_experts else slice(None)
    a = a.view(held, -1, a.shape[-1]).transpose(1, 2)[mine].to(dtype)
    b = b.view(b.shape[0], -1, held).permute(2, 1, 0)[mine].to(dtype)
    # B is small ([out, r·E]); grouped kernels need it row-major, hence the copy
    b = (b * wrapper.scaling[adapter]).contiguous()
    return _Factors(*pad_rank(a, b), wrapper.lora_dropout[adapter])


_RANK_ALIGN = 8  # grouped GEMM rows must be 16-byte aligned: 8 bf16 values


def pad_rank(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad the rank to a multiple of 8, so the (tokens × r) product of every rank runs
    on the grouped kernels (CUDA's, and the meta kernel the planner's trace runs); zero
    columns of A meet zero rows of B, so the update is the same."""
    pad = -a.shape[-1] % _RANK_ALIGN
    if pad == 0:
        return a, b
    return F.pad(a, (0, pad)), F.pad(b, (0, 0, 0, pad))


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x (S, in) sorted by expert, w (E, in, out) -> (S, out): row i meets only its expert."""
    if _grouped_kernel_ok(x, w):
        return F.grouped_mm(x, w, offs=offsets)
    return _looped_mm(x, w, offsets)


def _grouped_kernel_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not hasattr(F, "grouped_mm") or x.dtype != w.dtype:
        return False
    if x.device.type == "cpu":  # its CPU kernel takes no float64
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    # CUDA grouped GEMM: bf16, sm80+, 16-byte aligned row strides
    aligned = x.shape[-1] % 8 == 0 and w.shape[-1] % 8 == 0
    return aligned and torch.cuda.get_device_capability(x.device) >= (8, 0)


def _looped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """One matmul per expert with tokens; split/unbind keep the backward free of full zeros."""
    ends = offsets.tolist()
    counts = [end - start for start, end in zip([0, *ends[:-1]], ends, strict=True)]
    chunks = x[: ends[-1]].split(counts)
    parts = [chunk @ we for chunk, we in zip(chunks, w.unbind(0), strict=True) if len(chunk)]
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[-1])


class _QuantizedGroupedLinear(torch.autograd.Function):
    """`_grouped_mm` on a QuantizedStack: one expert dequantised at a time, in forward and
    again in backward, so no float stack is ever built or saved (frozen: no weight grad)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, stack: QuantizedStack,
                offsets: torch.Tensor) -> torch.Tensor:  # fmt: skip
        ctx.stack = stack
        ctx.save_for_backward(offsets)
        return _per_expert(x, stack, offsets, backward=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (offsets,) = ctx.saved_tensors
        return _per_expert(grad, ctx.stack, offsets, backward=True), None, None


def _per_expert(x: torch.Tensor, stack: QuantizedStack, offsets: torch.Tensor,
                backward: bool) -> torch.Tensor:  # fmt: skip
    """Rows sorted by expert through W_e (x·W_eᵀ), or back through it (grad·W_e)."""
    shape = (x.shape[0], stack.out_in[1 if backward else 0])
    into = x.new_empty(stack.out_in)  # one expert's weights, reused: no allocation per expert
    if isinstance(x, FakeTensor) or x.is_meta:
        # planner traces: no routing values, but the same bytes – the output, the reused
        # expert buffer and one expert's transients (all rows through expert 0)
        out = x.new_empty(shape)
        _expert_mm(x, *stack.factored_expert(0, into), out, backward)
        return out
    ends = offsets.tolist()
    # every row belongs to an expert (ends[-1] == rows) unless routing dropped some
    out = x.new_empty(shape) if ends[-1] == x.shape[0] else x.new_zeros(shape)
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            _expert_mm(x[start:end], *stack.factored_expert(e, into), out[start:end], backward)
        start = end
    return out


def _expert_mm(rows: torch.Tensor, v: torch.Tensor, scale: torch.Tensor | None,
               out: torch.Tensor, backward: bool) -> None:  # fmt: skip
    """rows·Wᵀ (or rows·W) into `out`, W = scale[:, None]·v: the per-output-row scale goes on
    the (rows × out) side, a fraction of the (out × in) weight's elements."""
    if not backward:
        torch.mm(rows, v.t(), out=out)
        if scale is not None:
            out.mul_(scale)
        return
    if scale is not None:  # computed at the scale's precision, rounded once to the rows' dtype
        rows = torch.mul(rows, scale, out=torch.empty_like(rows))
    torch.mm(rows, v, out=out)


class _StreamedGroupedLinear(torch.autograd.Function):
    """`_grouped_mm` on an offloaded stack: fetched from its store in forward and again in
    backward; only the reference is saved, so autograd never keeps a layer on the device."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ref: StackRef, offsets: torch.Tensor) -> torch.Tensor:
        ctx.ref = ref
        ctx.save_for_backward(offsets)
        return _through(ref.fetch(), x, offsets, ref.transposed, backward=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (offsets,) = ctx.saved_tensors
        weight = ctx.ref.fetch(backward=True)
        return _through(weight, grad, offsets, ctx.ref.transposed, backward=True), None, None


def _through(w: torch.Tensor | QuantizedStack, x: torch.Tensor, offsets: torch.Tensor,
             transposed: bool, backward: bool) -> torch.Tensor:  # fmt: skip
    """x·W_eᵀ per expert group (forward), or grad·W_e (the input gradient)."""
    if isinstance(w, QuantizedStack):
        return _per_expert(x, w, offsets, backward)
    # w is [E, out, in], or [E, in, out] when transposed; grouped_mm wants (E, in, out)
    return grouped_mm(x, w.transpose(-2, -1) if transposed == backward else w, offsets)


class SplitParamWrapper(ParamWrapper):
    """A `ParamWrapper` whose factors the experts forward applies (no weight parametrization).

    Parameters, names and state dict are the wrapper's own, so saving, loading, adapter
    switching and merging stay peft's; only `forward` differs.
    """

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._check_forward_args(x, *args, **kwargs)
        kwargs.pop("adapter_names", None)
        if self.disable_adapters and self.merged:
            self.unmerge()
        return self.base_layer(x, *args, **kwargs)


# peft recognises its wrapper by class name while injecting (tuners_utils.py,
# `create_and_replace_param`: a further parameter or adapter on wrapped experts), so the
# split wrapper answers to that name; isinstance still tells the two apart.
SplitParamWrapper.__name__ = ParamWrapper.__name__


def register() -> None:
    """Register "moetune_lora" in transformers' experts interface, and switch every peft
    wrapper later put on such experts to the split path (idempotent).

    transformers checks the name when a model loads, so this runs before
    `from_pretrained(..., experts_implementation="moetune_lora")`. peft then builds its
    `ParamWrapper`s on that model (`get_peft_model`, `PeftModel.from_pretrained`) and
    installs each with a plain `setattr`; torch's global module-registration hook sees it
    there, before any forward, and switches it as `apply_split_lora(model)` would (no
    dropout: peft's config cannot carry it on experts). So a user's own script trains
    split LoRA without calling moetune again.
    """
    global _HOOK
    ExpertsInterface.register(IMPLEMENTATION, split_lora_experts_forward)
    if _HOOK is None:
        _HOOK = register_module_module_registration_hook(_split_on_arrival)


_HOOK: RemovableHandle | None = None  # the module-registration hook, installed once


def _split_on_arrival(parent: nn.Module, name: str, module: nn.Module | None) -> None:
    """Torch calls this on every submodule registration; it acts only on a peft wrapper of
    fused experts whose model selected "moetune_lora" (returns None: `module` stays)."""
    if not isinstance(module, ParamWrapper) or _is_switched(module):
        return
    experts = module.get_base_layer()
    if getattr(getattr(experts, "config", None), "_experts_implementation", None) == IMPLEMENTATION:
        _switch(module, 0.0)


def apply_split_lora(model: nn.Module, *, dropout: float = 0.0) -> list[str]:
    """Switch a peft model's LoRA on fused experts to the split path; returns the wrappers switched.

    `model` was wrapped by peft with `target_parameters` on experts projections
    (gate_up_proj / up_proj / down_proj). `dropout` applies to the experts' LoRA input
    only, as peft does for `nn.Linear` (peft itself forbids it on ParamWrapper). Other
    parameter targets stay on peft's path. Calling it again only changes the dropout.
    Undo with `restore_peft_lora`. On an error the model is left as it was.
    """
    if not 0.0 <= dropout < 1.0:
        raise EngineError(f"expert LoRA dropout {dropout} is outside [0, 1).", "use e.g. 0.05.")
    base = _transformers_model(model)
    register()
    switched = [name for name, wrapper in _param_wrappers(model) if _switch(wrapper, dropout)]
    if not switched:
        raise EngineError(
            "no fused experts carry LoRA from peft's target_parameters.",
            'build the peft model with target_parameters=["mlp.experts.gate_up_proj", '
            '"mlp.experts.down_proj"] on a family decorated with @use_experts_implementation.',
        )
    base.__dict__.setdefault(_PREVIOUS, base.get_experts_implementation())
    base.set_experts_implementation(IMPLEMENTATION)
    if not all(_dispatches_here(w) for _, w in _param_wrappers(model) if _is_switched(w)):
        restore_peft_lora(model)
        raise EngineError(
            f"{type(base).__name__} did not route its experts to {IMPLEMENTATION}.",
            "load the model with experts_implementation='moetune_lora'.",
        )
    return switched


def _switch(wrapper: ParamWrapper, dropout: float) -> bool:
    """Put one wrapper on the split path if it adapts a fused experts projection."""
    experts = wrapper.get_base_layer()
    if not is_fused_experts(experts) or wrapper.parameter_name not in PROJECTIONS:
        return False
    experts.__dict__.setdefault(_STATE, {})[wrapper.parameter_name] = wrapper
    _retype(wrapper, SplitParamWrapper)
    _set_dropout(wrapper, dropout)
    return True


def train_only(experts: nn.Module, keep: torch.Tensor | None) -> None:
    """Run only the LoRA of the experts `keep` ([E] bool) marks on the split path; None: all.

    For expert selection (train/routing/select.py), whose gradient masks keep the other experts'
    ΔW exactly zero, so skipping their update changes nothing but the work done.
    """
    if keep is None or bool(keep.all()):
        experts.__dict__.pop(_KEEP, None)
    else:
        experts.__dict__[_KEEP] = keep.detach().bool()


def restore_peft_lora(model: nn.Module) -> None:
    """Undo `apply_split_lora`: peft's stock ParamWrapper path and the previous experts forward."""
    for _, wrapper in _param_wrappers(model):
        if _is_switched(wrapper):
            _retype(wrapper, ParamWrapper)
            _set_dropout(wrapper, 0.0)  # peft's path cannot apply it
            wrapper.get_base_layer().__dict__.pop(_STATE, None)
            wrapper.get_base_layer().__dict__.pop(_KEEP, None)
    base = _transformers_model(model)
    previous = base.__dict__.pop(_PREVIOUS, None)
    if previous is not None:
        base.set_experts_implementation(previous)


def is_split(model: nn.Module) -> bool:
    """Whether any of the model's experts LoRA runs on the split path."""
    return any(_is_switched(w) for _, w in _param_wrappers(model))


def _param_wrappers(model: nn.Module) -> Iterator[tuple[str, ParamWrapper]]:
    for name, module in model.named_modules():
        if isinstance(module, ParamWrapper):
            yield name, module


def is_fused_experts(module: nn.Module) -> bool:
    """Set by `@use_experts_implementation` on the experts classes it decorates."""
    return all(hasattr(module, flag) for flag in ("has_gate", "has_bias", "is_transposed"))


def _retype(wrapper: nn.Module, cls: type[nn.Module]) -> None:
    """Swap a wrapper between peft's class and ours; its state stays as it is."""
    wrapper.__class__ = cls


def apply_lora_dropout(model: nn.Module, p: float) -> int:
    """Dropout `p` on every LoRA layer peft built without it (the config carried 0 because
    peft's ParamWrapper refuses dropout); ParamWrappers are apply_split_lora's. Returns how
    many layers it set."""
    # lazy: heavy to import (peft)
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    layers = [m for m in layers if not isinstance(m, ParamWrapper)]
    for layer in layers:
        _set_dropout(layer, p)
    return len(layers)


def _set_dropout(wrapper: Any, p: float) -> None:
    """Dropout on the LoRA input of every adapter of one peft LoRA layer."""
    for adapter in wrapper.lora_A:
        wrapper.lora_dropout[adapter] = nn.Dropout(p) if p > 0 else nn.Identity()


def _transformers_model(model: nn.Module) -> Any:
    """The transformers model under peft, whose config selects the experts forward."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    if not hasattr(base, "set_experts_implementation"):
        raise EngineError(
            f"{type(base).__name__} is not a transformers model; cannot select an experts forward.",
            "apply peft to a transformers PreTrainedModel (AutoModelForCausalLM).",
        )
    return base


def _is_switched(wrapper: ParamWrapper) -> bool:
    return isinstance(wrapper, SplitParamWrapper)


def _dispatches_here(wrapper: ParamWrapper) -> bool:
    config = getattr(wrapper.get_base_layer(), "config", None)
    return getattr(config, "_experts_implementation", None) == IMPLEMENTATION


register()
