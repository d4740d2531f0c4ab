"""Data-dependent ops in a traced step, answered with a balanced routing.

Fake tensors carry shapes, not values, so an op whose output shape or Python result
depends on values – `aten.nonzero` (`torch.where(mask)`, a boolean index), `.item()` /
`.tolist()` – has no fake kernel. Eager expert loops (longcat_flash, glm5_next, qwen4_exp,
step3p5) and jetmoe's gate read their routing that way. `BalancedRouting` answers them
deterministically:

- every `aten.topk` routes balanced: row r's k slots pick experts (r·k + j) mod n, so each
  of n experts gets top_k × tokens / n tokens – the bound the analytic planner assumes,
  and the step a load-balanced router aims at;
- small tensors computed from nothing but shapes, integers and the routing (one-hot
  masks, expert counts, causal masks, arange) carry their real values alongside – a
  *shadow* – computed on real CPU tensors outside every dispatch mode;
- a data-dependent op on shadowed inputs is answered from the shadows: its fake output
  has the shape the real op gives, and `.item()` returns the real number.

On a real run (`fake=None`) only the routing is replaced: indices balanced, values
gathered at them, so a fake trace and a real step of the same config allocate the same
bytes. Nothing here allocates what the tracker counts: it sits below the `ByteTracker`,
which sees each op's outputs only. Types without data-dependent ops trace as before –
their shapes never read a shadow.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from moetune.errors import TraceError

_SHADOW = "_moetune_value"  # the attribute a fake tensor's real value is kept in
SHADOW_BYTES = 64 << 20  # a bigger tensor keeps no shadow (a 4k × 4k bool causal mask fits)
_TOPK = torch.ops.aten.topk.default
_NONZERO = torch.ops.aten.nonzero.default
_ITEM = torch.ops.aten._local_scalar_dense.default
_INDEX = torch.ops.aten.index.Tensor
_aten = torch.ops.aten
# values undefined until written (a model's parameters are made this way): never shadowed
_UNDEFINED = {_aten.empty, _aten.empty_like, _aten.empty_strided, _aten.new_empty,
              _aten.new_empty_strided}  # fmt: skip
_CAT = _aten.cat.default
_UNKNOWN = object()  # what _follow_real gives where the real value cannot be computed
# ops that turn a NaN (an unknown element, see _unknown_as_nan) into a number
_NAN_HIDING = {_aten.nan_to_num, _aten.fmax, _aten.fmin, _aten.nansum, _aten.nanmean,
               _aten.nan_to_num_}  # fmt: skip


def balanced_indices(rows: int, k: int, n: int) -> torch.Tensor:
    """(rows, k) int64: row r's slot j is expert (r·k + j) mod n – every expert equally."""
    return (torch.arange(rows * k, dtype=torch.long) % n).view(rows, k)


def balanced_topk(shape: torch.Size, k: int, dim: int) -> torch.Tensor:
    """topk's indices for an input of `shape`: `dim` cut to k, balanced over shape[dim]."""
    dim = dim % len(shape)
    n = shape[dim]
    rest = [s for i, s in enumerate(shape) if i != dim]
    flat = balanced_indices(int(torch.Size(rest).numel()), k, n)
    return flat.view(*rest, k).movedim(-1, dim)


def shadow(t: torch.Tensor) -> torch.Tensor | None:
    """The real value a fake tensor stands for, where it is known."""
    if not isinstance(t, FakeTensor):
        return None if t.is_meta else t  # a real tensor is its own value
    value: torch.Tensor | None = getattr(t, _SHADOW, None)
    return value


def _set_shadow(fake: Any, real: Any) -> None:
    if not (isinstance(fake, FakeTensor) and isinstance(real, torch.Tensor)):
        return
    if _nbytes(real) <= SHADOW_BYTES and real.shape == fake.shape:
        setattr(fake, _SHADOW, real)


def _drop_shadow(t: Any) -> None:
    if isinstance(t, FakeTensor) and hasattr(t, _SHADOW):
        delattr(t, _SHADOW)


class BalancedRouting(TorchDispatchMode):
    """See the module docstring; `fake` is the trace's FakeTensorMode, None on a real run."""

    def __init__(self, fake: FakeTensorMode | None) -> None:
        super().__init__()
        self.fake = fake
        self.answered = 0  # data-dependent ops answered from shadows (tests read it)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is _TOPK:
            return self._topk(func, args, kwargs)
        if self.fake is None:
            return func(*args, **kwargs)
        if func is _ITEM and getattr(args[0], "constant", None) is not None:
            return func(*args, **kwargs)  # fake tensors know a few scalars themselves
        if func in (_NONZERO, _ITEM) or (func is _INDEX and _bool_index(args)):
            return self._answer(func, args, kwargs)
        out = func(*args, **kwargs)
        self._follow(func, args, kwargs, out)
        return out

    def _topk(self, func: Any, args: tuple, kwargs: dict) -> Any:
        x, k = args[0], int(args[1])
        dim = int(args[2]) if len(args) > 2 else int(kwargs.get("dim", -1))
        values, indices = func(*args, **kwargs)
        with _disable_current_modes():
            balanced = balanced_topk(x.shape, k, dim)
        if self.fake is not None:
            _set_shadow(indices, balanced)
            return values, indices
        balanced = balanced.to(indices.device)
        return x.gather(dim, balanced), balanced

    def _answer(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A data-dependent op: computed on the shadows, given back as the real op gives it."""
        if func is _INDEX:  # a boolean index is its nonzero: index with those positions
            base, indices = args[0], list(args[1])
            longs = [self._nonzero_of(i) if _is_bool(i) else i for i in indices]
            positions: list[Any] = []
            for found, index in zip(longs, indices, strict=True):
                positions.extend(found.unbind(1) if _is_bool(index) else [found])
            return self._follow_out(func, (base, positions, *args[2:]), kwargs)
        real = self._real(func, args, kwargs)
        if func is _ITEM:
            self.answered += 1
            return real
        return self._fake_of(real)

    def _nonzero_of(self, index: torch.Tensor) -> torch.Tensor:
        return self._fake_of(self._real(_NONZERO, (index,), {}))

    def _follow_out(self, func: Any, args: tuple, kwargs: dict) -> Any:
        out = func(*args, **kwargs)
        self._follow(func, args, kwargs, out)
        return out

    def _fake_of(self, real: torch.Tensor) -> torch.Tensor:
        assert self.fake is not None
        self.answered += 1
        out = self.fake.from_tensor(real)
        _set_shadow(out, real)
        return out

    def _real(self, func: Any, args: tuple, kwargs: dict) -> Any:
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if not all(_known(shadow(t)) for t in tensors):
            raise TraceError(
                f"{func} reads values the trace does not know (a tensor computed from weights).",
                "plan this model with the analytic estimator (--estimator analytic).",
            )
        with _disable_current_modes():
            return func(*_reals(args), **_reals(kwargs))

    def _follow(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Give `out` (and any tensor the op wrote) the real value, where every input has one."""
        real = self._follow_real(func, args, kwargs, out)
        if real is _UNKNOWN:
            for t in _written(func, args, kwargs):
                _drop_shadow(t)  # its value is no longer known
            return
        outs, _ = tree_flatten(out)
        reals, _ = tree_flatten(real)
        for fake_out, real_out in zip(outs, reals, strict=False):
            _set_shadow(fake_out, real_out)

    def _follow_real(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if not _small((out, _written(func, args, kwargs))) or func.overloadpacket in _UNDEFINED:
            return _UNKNOWN
        values = [shadow(t) for t in tensors]
        if func is _CAT and any(v is not None for v in values):
            args = (_unknown_as_nan(args[0]), *args[1:])  # a mask packed beside activations
        elif any(v is None for v in values):
            return _UNKNOWN
        hides = func.overloadpacket in _NAN_HIDING or not _floating(out)
        if hides and not all(_known(v) for v in values):
            return _UNKNOWN  # a NaN (unknown) would turn into a number nobody computed
        with _disable_current_modes():
            try:
                return func(*_reals(args), **_reals(kwargs))  # None for an in-place foreach
            except Exception:  # an op the CPU cannot run on these values: no shadow
                return _UNKNOWN


def _known(value: torch.Tensor | None) -> bool:
    """A value with no unknown (NaN-marked) element."""
    if value is None:
        return False
    if not value.is_floating_point():
        return True
    with _disable_current_modes():
        return not bool(torch.isnan(value).any())


def _floating(out: Any) -> bool:
    leaves, _ = tree_flatten(out)
    return all(t.is_floating_point() for t in leaves if isinstance(t, torch.Tensor))


def _unknown_as_nan(tensors: list[Any]) -> list[Any]:
    """cat's inputs with each unknown floating tensor as a real NaN-filled one (unknown)."""
    out = []
    for t in tensors:
        if shadow(t) is None and t.is_floating_point() and _nbytes(t) <= SHADOW_BYTES:
            with _disable_current_modes():
                t = torch.full(t.shape, float("nan"), dtype=t.dtype)
        out.append(t)
    return out


def _reals(tree: Any) -> Any:
    return tree_map(lambda t: shadow(t) if isinstance(t, torch.Tensor) else t, tree)


def _small(out: Any) -> bool:
    leaves, _ = tree_flatten(out)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(_nbytes(t) <= SHADOW_BYTES for t in tensors)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments `func` writes in place (its schema's mutable arguments)."""
    out: list[torch.Tensor] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            out.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    return out


def _is_bool(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _bool_index(args: tuple) -> bool:
    return any(_is_bool(i) for i in args[1] if i is not None)
