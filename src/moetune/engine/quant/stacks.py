"""Frozen expert stacks stored int8 or NF4, dequantised one expert at a time.

bitsandbytes 4-bit replaces only `nn.Linear`, so the fused 3-D expert stacks of a
transformers 5.x MoE (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]; gpt_oss and llama4
store [E, in, out]) stay bf16 – the bulk of the model. Here each stack becomes a
`QuantizedStack` (buffers, no gradients) in `experts.quantized[name]` and the float
Parameter is deleted. `expert_weight` / `expert_linear` give one expert's matrix (the
split-LoRA forward); any other experts forward still runs, because reading
`experts.gate_up_proj` on a quantised module dequantises that stack for the call.
`quant.load.load_quantized` quantises while streaming a checkpoint, on the CPU.

Storage is kept in a canonical [E, out, in] layout whatever the family's order, so int8
scales are per output row and NF4 blocks follow the input dim.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from moetune.config.keys import splits
from moetune.errors import MoetuneError
from moetune.registry import Registry

if TYPE_CHECKING:
    pass

QUANTIZED = "quantized"  # experts module attribute: ModuleDict {parameter name: QuantizedStack}
_PENDING = "_moetune_pending"  # loader: {parameter name: plan} for stacks still to arrive
_ORDER = "_moetune_parameter_order"  # the float module's parameter names, in order
_VIEWS = "_moetune_byte_views"  # a shardable stack: {name: dtype} of its float tensors as bytes
# Unflagged experts classes (no @use_experts_implementation) that store [E, in, out].
TRANSPOSED_EXPERTS: set[str] = {"Llama4TextExperts"}

_TINY = torch.finfo(torch.float32).tiny  # divisor floor: an all-zero row/block stays zero


class QuantError(MoetuneError):
    """Expert stacks cannot be quantised or loaded as asked."""


class Quantizer:
    """A storage format for a float stack [E, out, in] as buffers with a leading E dim.

    Of the registered backends serving a `method`, the available one with the highest
    `priority` is used: a library backend (torchao, bitsandbytes) can take over when installed.
    """

    name: ClassVar[str]
    method: ClassVar[str]  # the experts_dtype it serves: "int8" | "nf4"
    priority: ClassVar[int] = 0
    double_quant: ClassVar[bool] = False  # whether it can double-quantise its scales
    stored: ClassVar[bool] = False  # a published checkpoint format: read as stored, not made

    @classmethod
    def available(cls) -> bool:
        return True

    @classmethod
    def quantize(cls, w: torch.Tensor, *, double_quant: bool) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    @classmethod
    def configured(cls, **options: Any) -> type[Quantizer]:
        """The backend that reads buffers quantised with `options` (a published format's
        block size: its buffers alone cannot tell it); most need none."""
        return cls

    @classmethod
    def dequantize(cls, buffers: dict[str, torch.Tensor], out_in: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        """Buffers sliced to some experts -> their float matrices [e, out, in]."""
        raise NotImplementedError

    @classmethod
    def dequantize_into(cls, buffers: dict[str, torch.Tensor], out_in: tuple[int, int],
                        out: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """As `dequantize` (same values, bit for bit) into `out` [e, out, in] where the format
        can write there: a buffer reused across experts, no allocation or cast per expert."""
        return cls.dequantize(buffers, out_in, out.dtype)

    @classmethod
    def factored(cls, buffers: dict[str, torch.Tensor], out_in: tuple[int, int],
                 out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """(V, s) with W = s[:, None] · V for one expert ([1, out, in]; s [1, out] or None):
        a format with per-output-row scales lets the matmul scale its (rows × out) result
        instead of the (out × in) weight."""
        return cls.dequantize_into(buffers, out_in, out), None


QUANTIZERS: Registry[type[Quantizer]] = Registry("quantizer backend", QuantError)


def register(cls: type[Quantizer]) -> type[Quantizer]:
    return QUANTIZERS.add(cls.name, cls)


def quantizer_for(
    method: str, *, double_quant: bool = False, stored: bool = False
) -> type[Quantizer]:
    """The backend used for `method` here: the highest-priority available one; a published
    format (`stored`) only where asked – the planner's trace builds a stored base with it."""
    backends = [q for _, q in QUANTIZERS.items() if stored or not q.stored]
    found = [q for q in backends if q.method == method and q.available()]
    if not found:
        methods = sorted({q.method for q in backends})
        raise QuantError(f"no quantizer for experts dtype {method!r}.", f"use one of {methods}.")
    best = max(found, key=lambda q: q.priority)
    if double_quant and not best.double_quant:
        raise QuantError(f"{method} has no scales to double-quantise.",
                         "set double_quant only with nf4.")  # fmt: skip
    return best


class QuantizedStack(nn.Module):
    """A frozen expert stack as a backend's buffers: no Parameters, no gradients.

    `shape` is the original stack's ([E, in, out] if `transposed`); `dtype` is the compute
    dtype dequantisation returns by default (the float stack's).
    """

    def __init__(self, shape: tuple[int, int, int], transposed: bool, dtype: torch.dtype,
                 backend: str | type[Quantizer],
                 buffers: dict[str, torch.Tensor]) -> None:  # fmt: skip
        super().__init__()
        self.shape, self.transposed, self.dtype = shape, transposed, dtype
        # a class: one configured for its checkpoint (BlockFP8's weight_block_size)
        self.backend = QUANTIZERS.get(backend) if isinstance(backend, str) else backend
        for name, tensor in buffers.items():
            self.register_buffer(name, tensor)

    @classmethod
    def from_float(cls, weight: torch.Tensor, method: str = "int8", *, transposed: bool = False,
                   double_quant: bool = False, chunk: int = 8,
                   options: dict[str, Any] | None = None) -> QuantizedStack:  # fmt: skip
        """Quantise [E, out, in] (or [E, in, out] if transposed), `chunk` experts at a time;
        `options`: a published format's blocks or groups (StoredFormat.options)."""
        found = quantizer_for(method, double_quant=double_quant, stored=True)
        backend = found.configured(**(options or {}))
        canonical = weight.detach().transpose(1, 2) if transposed else weight.detach()
        parts = [backend.quantize(c.float(), double_quant=double_quant, **(options or {}))
                 for c in canonical.split(chunk)]  # fmt: skip
        buffers = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        shape = (weight.shape[0], weight.shape[1], weight.shape[2])
        return cls(shape, transposed, weight.dtype, backend, buffers)

    @property
    def out_in(self) -> tuple[int, int]:
        _, a, b = self.shape
        return (b, a) if self.transposed else (a, b)

    def canonical_expert(self, e: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Expert e as [out, in], read from its own slice of each buffer only."""
        parts = {name: buf[e : e + 1] for name, buf in self.stored().items()}
        return self.backend.dequantize(parts, self.out_in, dtype or self.dtype)[0]

    def factored_expert(self, e: int, into: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Expert e as (V [out, in], s [out] or None), W_e = s[:, None]·V, V written into
        `into` ([out, in], the compute dtype) where the backend can (`Quantizer.factored`)."""
        parts = {name: buf[e : e + 1] for name, buf in self.stored().items()}
        v, s = self.backend.factored(parts, self.out_in, into.unsqueeze(0))
        return v[0], None if s is None else s[0]

    def expert(self, e: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Expert e shaped as the original stack's slice."""
        w = self.canonical_expert(e, dtype)
        return w.t() if self.transposed else w

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole stack in float, original layout (tests, stock forwards)."""
        w = self.backend.dequantize(self.stored(), self.out_in, dtype or self.dtype)
        return w.transpose(1, 2) if self.transposed else w

    def stored(self) -> dict[str, torch.Tensor]:
        """The stored tensors by name, each in its own dtype: buffers, or – once made
        shardable for FSDP (`shardable_`) – frozen Parameters, float ones held as bytes."""
        views = self.__dict__.get(_VIEWS, {})
        out = {n: b for n, b in self._buffers.items() if b is not None}
        for name, p in self._parameters.items():
            if p is not None:
                out[name] = p.view(views[name]) if name in views else p
        return out

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.stored().values())

    @property
    def device(self) -> torch.device:
        return next(iter(self.stored().values())).device

    def _apply(self, fn: Any, recurse: bool = True) -> QuantizedStack:
        # Module.to(dtype) would cast the fp32 scales; keep the storage exact, move it
        # only, and let the dtype change the compute dtype as it would a float weight.
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.device))
        for name, buf in list(self._buffers.items()):
            self._buffers[name] = _moved(buf, probe.device)
        for name, param in list(self._parameters.items()):
            self._parameters[name] = _frozen(_moved(param, probe.device))
        self.dtype = probe.dtype
        return self


def _moved(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    assert tensor is not None
    # a meta tensor has nothing to copy: to_empty (planner traces) gives it storage
    return torch.empty_like(tensor, device=device) if tensor.is_meta else tensor.to(device)


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor.detach(), requires_grad=False)


def shardable_(model: nn.Module) -> nn.Module:
    """Make every quantised stack's tensors frozen Parameters, so FSDP2 (which shards
    Parameters only, never buffers) shards them by expert (dim 0) and all-gathers a layer's
    while it runs; float tensors (scales, absmax) are held as bytes, so a mixed-precision
    policy never casts them. Each module's stacks in the float order: every rank of a
    sharded load then walks the same state dict. The values are unchanged (`stored()`)."""
    for module in model.modules():
        stacks = _in_float_order(module)
        holder = module._modules.get(QUANTIZED)
        for name, stack in stacks:
            assert holder is not None
            del holder._modules[name]  # re-added last, so in the float order
            holder.add_module(name, _as_parameters(stack))
    return model


def _as_parameters(stack: QuantizedStack) -> QuantizedStack:
    views = stack.__dict__.setdefault(_VIEWS, {})
    for name in list(stack._buffers):
        tensor = stack._buffers.pop(name)
        assert tensor is not None
        if tensor.is_floating_point():
            views[name] = tensor.dtype
            tensor = tensor.view(torch.uint8)
        stack._parameters[name] = _frozen(tensor)
    return stack


def stack_nbytes(shape: tuple[int, int, int], method: str, *, double_quant: bool = False) -> int:
    """Storage bytes of a quantised [E, out, in] stack, from a meta build (the planner's)."""
    meta = torch.empty(shape, device="meta")
    return QuantizedStack.from_float(meta, method, double_quant=double_quant).nbytes


class _QuantizedExperts(nn.Module):
    """Mixed into an experts module's class once its stacks are quantised (or pending)."""

    def __getattr__(self, name: str) -> Any:
        stacks = self.__dict__["_modules"].get(QUANTIZED)
        if stacks is not None and name in stacks._modules:
            return stacks._modules[name].dequantize()  # stock forwards: whole stack, transient
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        pending = self.__dict__.get(_PENDING)
        if pending and name in pending and isinstance(value, torch.Tensor):
            _install(self, name, value, pending.pop(name))  # loader: a stack arrives
            return
        super().__setattr__(name, value)


_CLASSES: dict[type, type] = {}


def _mark_quantized(module: nn.Module) -> None:
    cls = type(module)
    if not issubclass(cls, _QuantizedExperts):
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"Quantized{cls.__name__}", (_QuantizedExperts, cls), {})
        module.__class__ = _CLASSES[cls]
        # peft nests one wrapper per parameter in this order: stand-ins must keep it
        module.__dict__[_ORDER] = list(module._parameters)
    if QUANTIZED not in module._modules:
        module.add_module(QUANTIZED, nn.ModuleDict())


def stacks_of(module: nn.Module) -> dict[str, QuantizedStack]:
    """The module's quantised stacks by parameter name (empty if none)."""
    stacks = module._modules.get(QUANTIZED) if isinstance(module, _QuantizedExperts) else None
    return dict(stacks.items()) if isinstance(stacks, nn.ModuleDict) else {}  # type: ignore[arg-type]


def is_transposed(module: nn.Module) -> bool:
    """Whether the module's stacks are [E, in, out] (flag set by @use_experts_implementation)."""
    flag = getattr(module, "is_transposed", None)
    if isinstance(flag, bool):
        return flag
    return any(c.__name__ in TRANSPOSED_EXPERTS for c in type(module).__mro__)


def expert_weight(module: nn.Module, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's float matrix (original slice layout), quantised stack or not."""
    stack = stacks_of(module).get(name)
    return stack.expert(e, dtype) if stack is not None else getattr(module, name)[e].to(dtype)


def expert_linear(module: nn.Module, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
    """x [n, in] through expert e's projection; a quantised weight is not saved for backward."""
    stack = stacks_of(module).get(name)
    if stack is not None:
        out: torch.Tensor = _DequantLinear.apply(x, stack, e)
        return out
    w = getattr(module, name)[e].to(x.dtype)
    return x @ w if is_transposed(module) else F.linear(x, w)


class _DequantLinear(torch.autograd.Function):
    """y = x·Wᵀ with W dequantised in forward and again in backward (frozen: no dW)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, stack: QuantizedStack, e: int) -> torch.Tensor:
        ctx.stack, ctx.e = stack, e
        return F.linear(x, stack.canonical_expert(e, x.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad @ ctx.stack.canonical_expert(ctx.e, grad.dtype), None, None


def experts_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module, list[str]]]:
    """(path, module, names of its 3-D float stacks) for every fused experts module."""
    for path, module in model.named_modules():
        names = [n for n, p in module.named_parameters(recurse=False)
                 if p.ndim == 3 and p.is_floating_point()]  # fmt: skip
        flagged = hasattr(module, "has_gate") and hasattr(module, "is_transposed")
        named = type(module).__name__.endswith("Experts") or path.rsplit(".", 1)[-1] == "experts"
        if names and (flagged or named):
            yield path.replace(".base_layer", ""), module, names  # peft nests wrappers


@dataclass(frozen=True)
class StackQuant:
    """One stack: bytes and the relative output error ‖x·Wqᵀ − x·Wᵀ‖/‖x·Wᵀ‖ over experts."""

    layer: str
    projection: str
    shape: tuple[int, int, int]
    bytes_before: int
    bytes_after: int
    error_mean: float
    error_max: float


@dataclass
class QuantReport:
    method: str
    double_quant: bool
    backend: str
    stacks: list[StackQuant] = field(default_factory=list)

    @property
    def bytes_before(self) -> int:
        return sum(s.bytes_before for s in self.stacks)

    @property
    def bytes_after(self) -> int:
        return sum(s.bytes_after for s in self.stacks)

    @property
    def max_error(self) -> float:
        return max((s.error_max for s in self.stacks), default=0.0)

    def to_json(self) -> dict[str, Any]:
        layers: dict[str, dict[str, Any]] = {}
        for s in self.stacks:
            row = {k: v for k, v in asdict(s).items() if k not in ("layer", "projection")}
            layers.setdefault(s.layer, {})[s.projection] = row
        return {"method": self.method, "double_quant": self.double_quant,
                "backend": self.backend, "bytes_before": self.bytes_before,
                "bytes_after": self.bytes_after, "max_error": self.max_error,
                "layers": layers}  # fmt: skip


@dataclass(frozen=True)
class _Plan:
    """How a module's stacks are quantised and where their storage goes."""

    method: str
    double_quant: bool
    report: QuantReport
    layer: str = ""
    device: torch.device | None = None  # None: stay where the float weight is
    error_experts: int | None = None  # experts measured per stack, evenly spread; None: all
    options: tuple[tuple[str, Any], ...] = ()  # a published format's blocks or groups


def _install(module: nn.Module, name: str, weight: torch.Tensor, plan: _Plan) -> None:
    """Quantise `weight` into module.quantized[name], record its error, drop the float."""
    stack = QuantizedStack.from_float(weight, plan.method, transposed=is_transposed(module),
                                      double_quant=plan.double_quant,
                                      options=dict(plan.options))  # fmt: skip
    errors = _output_errors(weight, stack, plan.error_experts)
    mean = sum(errors) / len(errors)
    row = StackQuant(plan.layer, name, stack.shape, weight.nbytes, stack.nbytes, mean, max(errors))
    plan.report.stacks.append(row)
    module.get_submodule(QUANTIZED).add_module(name, stack.to(plan.device or weight.device))
    module._parameters.pop(name, None)


def _output_errors(weight: torch.Tensor, stack: QuantizedStack, count: int | None) -> list[float]:
    """Per-expert relative output error on a fixed random batch (64 Gaussian rows)."""
    if count == 0 or weight.is_meta:
        return [math.nan]  # not asked for, or nothing to measure (planner traces)
    experts = stack.shape[0]
    picks = range(experts) if not count or count >= experts else (
        torch.linspace(0, experts - 1, count).round().long().tolist())  # fmt: skip
    x = torch.randn(64, stack.out_in[1], generator=torch.Generator().manual_seed(0))
    x = x.to(weight.device)
    errors = []
    for e in picks:
        w = weight[e].detach().float()
        y = F.linear(x, w.t() if stack.transposed else w)
        y_q = F.linear(x, stack.canonical_expert(e, torch.float32))
        errors.append(float((y_q - y).norm() / y.norm().clamp_min(_TINY)))
    return errors


def quantize_experts_(model: nn.Module, dtype: str = "int8", double_quant: bool = False, *,
                      error_experts: int | None = None,
                      options: dict[str, Any] | None = None) -> QuantReport:  # fmt: skip
    """Replace every fused expert stack by a QuantizedStack in place; the floats are freed.

    Plain or peft-wrapped models; to put LoRA on quantised experts, wrap inside
    `peft_targets`. The experts become frozen storage.
    """
    backend = quantizer_for(dtype, double_quant=double_quant, stored=True)
    report = QuantReport(dtype, double_quant, backend.name)
    plan = _Plan(dtype, double_quant, report, error_experts=error_experts,
                 options=tuple((options or {}).items()))  # fmt: skip
    for path, module, names in list(experts_modules(model)):
        _mark_quantized(module)
        for name in names:
            weight = module._parameters[name]
            assert weight is not None
            _install(module, name, weight, replace(plan, layer=path))
    if not report.stacks:
        raise QuantError("the model has no fused 3-D expert stacks to quantise.",
                         "use an MoE family with fused experts (transformers 5.x).")  # fmt: skip
    return report


def _in_float_order(module: nn.Module) -> list[tuple[str, QuantizedStack]]:
    """Stacks in the float module's parameter order (the loader installs them as they arrive)."""
    order = {name: i for i, name in enumerate(module.__dict__.get(_ORDER, []))}
    return sorted(stacks_of(module).items(), key=lambda item: order.get(item[0], len(order)))


@contextlib.contextmanager
def peft_targets(model: nn.Module) -> Iterator[None]:
    """Let peft see quantised stacks as `target_parameters`: call get_peft_model inside.

    peft matches `target_parameters` among Parameters only, so on a quantised model it
    silently adds no expert LoRA (peft 0.21.2). Inside, each stack shows a zero-storage
    stand-in Parameter of its shape, dtype and device; reads still dequantise.
    """
    added = [(m, n, s) for m in model.modules() for n, s in _in_float_order(m)
             if n not in m._parameters]  # fmt: skip
    for module, name, stack in added:
        empty = torch.zeros((), dtype=stack.dtype, device=stack.device).expand(stack.shape)
        module._parameters[name] = nn.Parameter(empty, requires_grad=False)
    try:
        yield
    finally:
        for module, name, _ in added:
            module._parameters.pop(name, None)


def require_split_engine(engine: str, experts_dtype: str) -> None:
    """Quantised stacks run only on the split-LoRA engine: peft's own experts path
    re-materialises every float stack (and its target_parameters match no quantised stack)."""
    if experts_dtype != "bf16" and not splits(engine):
        raise QuantError(
            f"experts_dtype={experts_dtype} needs moetune's engine; peft's own experts "
            "path re-materialises every float stack",
            "set lora.engine: auto or moetune (on a family it serves), or model.experts_dtype: "
            "bf16",
        )
