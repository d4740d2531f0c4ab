"""Load a base published quantised (FP8 / MXFP4 / NVFP4 / INT4) with its expert stacks kept as
the checkpoint stores them.

The model is built with meta Parameters. Each fused expert stack's buffers are read straight
from the safetensors files (per-expert keys back to back, `stack_files` layouts) into a
`QuantizedStack` of the stored format – no float copy of a stack exists at any time. Every
other quantised Linear (DeepSeek's FP8 attention, dense and shared MLP) becomes a
`StoredLinear` over its stored bytes (`keep_linears`, what training does), or is dequantised
to the compute dtype as it streams through transformers' loader, one tensor at a time (the
merged export, `model.quantized_base: dequantize`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from moetune.engine.direct_io import Piece, read_once
from moetune.engine.quant.load import _finish, _stream
from moetune.engine.quant.stacks import (
    QUANTIZED,
    QuantError,
    QuantizedStack,
    _mark_quantized,
    experts_modules,
    is_transposed,
    stacks_of,
)
from moetune.engine.stack_files import (
    LAYOUTS,
    Segment,
    dtype_name,
    expert_part,
    index_dir,
    keys_of,
    pieces_of,
    read_into,
)
from moetune.engine.stored.formats import StoredFormat, stored_format
from moetune.engine.stored.linear import StoredLinear, dequantize_linears_, replace_module
from moetune.errors import MoetuneError
from moetune.model.derive import causal_lm_class, ensure_backbone
from moetune.model.hf_config import quant_config_of
from moetune.model.sources import read_config

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedModel

# tensors a published checkpoint carries beside the weights that moetune's path does not use
_UNUSED = ("input_scale", "weight_shape", "weight_zero_point", "k_scale", "v_scale")
# tensors that move weights between groups: a format that does not read them must refuse
_REORDER = ("g_idx", "weight_g_idx")


@dataclass
class StoredReport:
    """What was kept as stored (the expert stacks, the other Linears) and what was dequantised."""

    format: str
    label: str
    stacks: int = 0
    stored_bytes: int = 0  # the expert stacks as held
    float_bytes: int = 0  # the same stacks in the compute dtype (what dequantising would hold)
    dequantized: list[str] = field(default_factory=list)  # other Linears, float at load
    dequantized_bytes: int = 0
    linears_stored: int = 0  # other quantised Linears kept as stored (StoredLinear)
    linears_bytes: int = 0
    backend: Any = field(default=None, repr=False)  # the format configured for the checkpoint

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "backend"}
        return {**out, "dequantized": len(self.dequantized)}


@dataclass(frozen=True)
class StackFiles:
    """Where one expert stack's stored buffers lie: buffer -> (segments, stacked shape, dtype)."""

    buffers: dict[str, tuple[list[Segment], tuple[int, ...], torch.dtype]]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for segs, _, _ in self.buffers.values() for s in segs)

    @property
    def experts(self) -> int:
        """The stack's experts (every buffer's leading dim)."""
        return next(iter(self.buffers.values()))[1][0]

    def prepare(
        self,
        device: torch.device | str = "cpu",
        only: tuple[str, ...] | None = None,
        empty: Callable[..., torch.Tensor] = torch.empty,
    ) -> tuple[dict[str, torch.Tensor], list[Piece]]:
        """Empty buffers on `device` (from `empty`) and the file pieces that fill them."""
        out, pieces = {}, []
        for name, (segs, shape, dtype) in self.buffers.items():
            if only is None or name in only:
                out[name] = empty(shape, dtype=dtype, device=device)
                pieces += pieces_of(segs, out[name])
        return out, pieces

    def read(self, only: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        out, pieces = self.prepare("cpu", only)
        read_once(pieces)
        return out

    def meta(self) -> dict[str, torch.Tensor]:
        return {n: torch.empty(shape, dtype=d, device="meta")
                for n, (_, shape, d) in self.buffers.items()}  # fmt: skip

    def part(self, rank: int, ranks: int) -> StackFiles:
        """Where rank `rank` of `ranks`' experts lie (expert parallelism): each buffer cut to
        its rows – every buffer is expert-major."""
        out = {}
        for buf, (segs, shape, dtype) in self.buffers.items():
            local = shape[0] // ranks
            part = slice(rank * local, (rank + 1) * local)
            out[buf] = (expert_part(segs, shape, part), (local, *shape[1:]), dtype)
        return StackFiles(out)


def checkpoint_format(model_dir: str | Path) -> tuple[type[StoredFormat], dict[str, Any]] | None:
    """The stored format of a local checkpoint's config.json, or of the hf_quant_config.json
    beside it (None: a float checkpoint)."""
    try:
        config = read_config(Path(model_dir) / "config.json")
    except MoetuneError:
        return None  # no readable config here: the loader says what is wrong with it
    qcfg = quant_config_of(config) if isinstance(config, dict) else None
    fmt = stored_format(qcfg)
    return None if fmt is None or not isinstance(qcfg, dict) else (fmt, qcfg)


def stack_files(fmt: type[StoredFormat], index: dict[str, Segment], prefix: str, name: str,
                shape: tuple[int, int, int], transposed: bool) -> StackFiles:  # fmt: skip
    """Find and shape-check stack `prefix.name`'s stored buffers in the checkpoint's files."""
    experts = shape[0]
    out_in = (shape[2], shape[1]) if transposed else (shape[1], shape[2])
    buffers = {}
    for buf, suffixes in fmt.keys.items():
        segs = _find(index, prefix, name, experts, suffixes)
        if segs is None:
            raise QuantError(
                f"{prefix}.{name}: the {fmt.label} checkpoint has no {suffixes[0]!r} tensors "
                "for it",
                "point model.id at the complete checkpoint, with its config.json",
            )
        buffers[buf] = (segs, _stacked_shape(segs, experts), segs[0].dtype)
    files = StackFiles(buffers)
    _fusable(fmt, len(next(iter(buffers.values()))[0]) // experts, out_in, f"{prefix}.{name}")
    fmt.check(files.meta(), out_in, f"{prefix}.{name}")
    return files


def _fusable(fmt: type[StoredFormat], parts: int, out_in: tuple[int, int], where: str) -> None:
    """Per-expert projections fused into one stack (gate + up) share its scale grid only where
    each ends on a whole block: a partial last block of gate would scale up's first rows."""
    rows = getattr(fmt, "block", (1, 1))[0]
    if parts > 1 and (out_in[0] // parts) % rows:
        raise QuantError(
            f"{where}: its {parts} fused projections of {out_in[0] // parts} rows each end in "
            f"a partial {rows}-row block, which a fused stack's scale grid cannot hold",
            "use the bf16 release of this base (moetune reads fused stacks in whole blocks)",
        )


def _find(index: dict[str, Segment], prefix: str, name: str, experts: int,
          suffixes: tuple[str, str]) -> list[Segment] | None:  # fmt: skip
    fused = index.get(f"{prefix}.{name}{suffixes[1]}")
    if fused is not None:
        return [fused]
    for layout_name, layout in LAYOUTS.items():
        if layout_name != "fused":
            found = layout(index, prefix, name, experts, suffixes[0])
            if found is not None:
                return found
    return None


def _stacked_shape(segs: list[Segment], experts: int) -> tuple[int, ...]:
    """Per-expert tensors concatenated along their rows (scalars side by side) under an E dim."""
    if len(segs) == 1 and segs[0].shape and segs[0].shape[0] == experts:
        return segs[0].shape  # fused: stored with its expert dim
    parts = len(segs) // experts
    first = segs[0].shape
    if len(first) == 0 or first == (1,):
        return (experts, parts)
    return (experts, parts * first[0], *first[1:])


class _Dequantized:
    """A quantised Linear's weight as transformers' loader reads it: `tensor[...]` dequantises."""

    def __init__(self, fmt: type[StoredFormat], segs: dict[str, Segment],
                 out_in: tuple[int, int], dtype: torch.dtype, key: str) -> None:  # fmt: skip
        self.fmt, self.segs, self.shape, self.dtype, self.key = fmt, segs, out_in, dtype, key

    def __getitem__(self, _: Any) -> torch.Tensor:
        bufs = read_linear(self.fmt, self.segs, self.shape, self.key)
        return self.fmt.dequantize(bufs, self.shape, self.dtype)[0]

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return dtype_name(self.dtype)


def read_linear(fmt: type[StoredFormat], segs: dict[str, Segment], out_in: tuple[int, int],
                where: str) -> dict[str, torch.Tensor]:  # fmt: skip
    """One Linear's stored tensors as buffers with a leading (one-expert) dim, checked."""
    bufs = {}
    for name, seg in segs.items():
        buf = torch.empty(seg.shape, dtype=seg.dtype)
        read_into([seg], buf)
        bufs[name] = buf.reshape(1, *(seg.shape or (1,)))
    fmt.check(bufs, out_in, where)
    return bufs


def quantised_linears(
    fmt: type[StoredFormat], index: dict[str, Segment], model: nn.Module
) -> dict[str, tuple[dict[str, Segment], tuple[int, int]]]:
    """Every quantised non-expert Linear of the built model: its module path -> the segments
    of its stored tensors and its [out, in]."""
    found = {}
    suffix = f".{fmt.weight_suffix()}"
    for key in index:
        if not key.endswith(suffix):
            continue
        base = key.removesuffix(suffix)
        segs = {b: index.get(f"{base}.{s}") for b, (s, _) in fmt.keys.items()}
        if len(segs) < 2 or any(v is None for v in segs.values()):
            continue  # a float tensor the format left alone (norms, embeddings, the router)
        try:
            param = model.get_parameter(f"{base}.weight")
        except AttributeError:
            continue  # not a parameter of the built model (expert keys: read as stacks)
        found[base] = (segs, (param.shape[0], param.shape[1]))
    return found  # type: ignore[return-value]


def dequantized_linears(fmt: type[StoredFormat], index: dict[str, Segment], model: nn.Module,
                        dtype: torch.dtype) -> dict[str, _Dequantized]:  # fmt: skip
    """Every quantised non-expert Linear weight, by the key transformers loads it under."""
    return {f"{base}.weight": _Dequantized(fmt, segs, out_in, dtype, base)
            for base, (segs, out_in) in quantised_linears(fmt, index, model).items()}  # fmt: skip


def store_linears_(fmt: type[StoredFormat], index: dict[str, Segment], model: nn.Module,
                   dtype: torch.dtype, report: StoredReport) -> list[str]:  # fmt: skip
    """Every quantised non-expert Linear as a StoredLinear over its stored bytes (on the CPU;
    the model moves with them); the paths."""
    found = quantised_linears(fmt, index, model)
    for base, (segs, out_in) in found.items():
        bufs = read_linear(fmt, segs, out_in, base)
        stack = QuantizedStack((1, *out_in), False, dtype, fmt, bufs)
        bias = model.get_submodule(base).bias  # meta: the stream fills it
        replace_module(model, base, StoredLinear(stack, bias))  # type: ignore[arg-type]
        report.linears_bytes += stack.nbytes
    report.linears_stored = len(found)
    return list(found)


def stored_keys(fmt: type[StoredFormat], index: dict[str, Segment],
                bases: Iterable[str]) -> set[str]:  # fmt: skip
    """Keys the stream must not read raw: quantised weights, their scales and unused extras."""
    suffixes = [s for s, _ in fmt.keys.values()] + list(_UNUSED)
    return {f"{b}.{s}" for b in bases for s in suffixes if f"{b}.{s}" in index}


def load_stored(
    model_dir: str | Path, device: str | torch.device, dtype: torch.dtype = torch.bfloat16,
    keep_linears: bool = False,
) -> tuple[PreTrainedModel, StoredReport]:  # fmt: skip
    """A causal LM from a published quantised checkpoint, expert stacks as stored on `device`;
    the other quantised Linears kept as stored too (`keep_linears`) or dequantised."""
    model, stacks, report = stream_all_but_stacks(model_dir, device, dtype, keep_linears)
    for (path, name), files in stacks.items():
        install_stack(model.get_submodule(path), name, files.read(), dtype, report, device)
    _finish(model, device)
    return model, report


def stream_all_but_stacks(
    model_dir: str | Path, device: str | torch.device, dtype: torch.dtype,
    keep_linears: bool = False,
) -> tuple[Any, dict[tuple[str, str], StackFiles], StoredReport]:  # fmt: skip
    """The model with every tensor but the expert stacks loaded onto `device` (the other
    quantised Linears kept as StoredLinears, or dequantised as they stream), where each stack
    lies, and the report begun."""
    model, fmt, index, stacks = open_stored(model_dir, dtype)
    report = StoredReport(fmt.name, fmt.label, backend=fmt)
    linears = {} if keep_linears else dequantized_linears(fmt, index, model, dtype)
    report.dequantized = sorted(linears)
    report.dequantized_bytes = sum(math.prod(d.shape) * dtype.itemsize for d in linears.values())
    kept = store_linears_(fmt, index, model, dtype, report) if keep_linears else []
    bases = [k.removesuffix(".weight") for k in linears] + kept
    held = (s for f in stacks.values() for segs, _, _ in f.buffers.values() for s in segs)
    skip = stored_keys(fmt, index, bases) | keys_of(index, held)
    _stream(model, Path(model_dir), {"": str(device)}, dtype, skip=skip, extra=linears)
    return model, stacks, report


def open_stored(
    model_dir: str | Path, dtype: torch.dtype
) -> tuple[Any, type[StoredFormat], dict[str, Segment], dict[tuple[str, str], StackFiles]]:
    """The meta-built model, its format, the files' index and where each stack's buffers lie –
    every shape checked before a byte of weights is read."""
    # lazy: heavy to import (accelerate, transformers)
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    found = checkpoint_format(model_dir)
    if found is None:
        raise QuantError(f"{model_dir} is not a quantised checkpoint (no quantization_config)",
                         "load it as a float base")  # fmt: skip
    fmt, _ = found
    config = AutoConfig.from_pretrained(model_dir)
    config.__dict__.pop("quantization_config", None)  # moetune reads the stored bytes itself
    with init_empty_weights(include_buffers=False):
        model = ensure_backbone(causal_lm_class(config)._from_config(config, dtype=dtype))
    index = index_dir(model_dir)
    _refuse_unread_reorder(fmt, index)
    stacks = {(path, n): stack_files(fmt, index, path, n, tuple(m._parameters[n].shape),  # type: ignore[union-attr,arg-type]
                                     is_transposed(m))
              for path, m, names in experts_modules(model) for n in names}  # fmt: skip
    return model, fmt, index, stacks


def _refuse_unread_reorder(fmt: type[StoredFormat], index: dict[str, Segment]) -> None:
    """A g_idx the format does not read would be dropped silently: weights in wrong groups."""
    read = {s for s, _ in fmt.keys.values()}
    unread = [
        k for k in index if k.rpartition(".")[2] in _REORDER and k.rpartition(".")[2] not in read
    ]
    if unread:
        raise QuantError(f"{unread[0]}: the checkpoint has g_idx tensors that its config.json "
                         f"does not declare (read as {fmt.label})",
                         "use the config.json published with these weights")  # fmt: skip


def install_stack(module: nn.Module, name: str, buffers: dict[str, torch.Tensor],
                  dtype: torch.dtype, report: StoredReport,
                  device: str | torch.device | None = None) -> QuantizedStack:  # fmt: skip
    """The stored buffers as `module.quantized[name]` in place of its (meta) float Parameter;
    real buffers have their scales checked (NaN / Inf / zero) first."""
    param = module._parameters[name]
    assert param is not None
    shape = (param.shape[0], param.shape[1], param.shape[2])
    backend = report.backend or report.format
    stack = QuantizedStack(shape, is_transposed(module), dtype, backend, buffers)
    where = f"{type(module).__name__}.{name}"
    stack.backend.check(dict(stack.named_buffers()), stack.out_in, where)  # type: ignore[attr-defined]
    _mark_quantized(module)
    module.get_submodule(QUANTIZED).add_module(name, stack if device is None else stack.to(device))
    module._parameters.pop(name)
    report.stacks += 1
    report.stored_bytes += stack.nbytes
    report.float_bytes += math.prod(param.shape) * dtype.itemsize
    return stack


def check_scales(like: QuantizedStack, files: StackFiles) -> None:
    """A stack left in the files: its scales alone read once and checked (NaN / Inf / zero)."""
    fmt = like.backend
    assert issubclass(fmt, StoredFormat)
    fmt.check(files.meta() | files.read(only=fmt.scales), like.out_in, "an expert stack")


def dequantize_stacks_(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Every quantised stack (and StoredLinear) back to a frozen float Parameter in place, one
    in float at a time (model.quantized_base: dequantize; the merged export). Returns how many."""
    done = 0
    for module in list(model.modules()):
        for name, stack in stacks_of(module).items():
            weight = stack.dequantize(dtype or stack.dtype)
            del module.get_submodule(QUANTIZED)._modules[name]
            module._parameters[name] = torch.nn.Parameter(weight, requires_grad=False)
            done += 1
    return done + dequantize_linears_(model)
