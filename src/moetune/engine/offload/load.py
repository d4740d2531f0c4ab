"""Load a base with its expert stacks offloaded: they never exist whole on the device, and
with `disk` never in host RAM either.

The model is built with meta Parameters; every tensor but the expert stacks streams onto the
device through transformers' loader (quant/load.py's _stream). Each stack's place in the
safetensors files is found from the headers (stack_files.stack_segments): `disk` keeps
just that, `cpu` reads the stack once into host RAM. Quantised experts (int8 / NF4) are
read, quantised on the CPU one stack at a time and kept in host RAM (`cpu`) or written to a
scratch file (`disk`): the files hold float weights only. Under expert parallelism a store
holds one rank's experts: its contiguous part at the load, and after a balanced placement
the experts placed on it (`hold_experts`, float stacks), read again from the same files.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from moetune.config.ep_split import check_divides
from moetune.engine.direct_io import Piece
from moetune.engine.offload.sources import Empty, FileFloat, Source, host_source, spill_source
from moetune.engine.offload.store import ExpertStore, Mode, attach, install, offloaded_of
from moetune.engine.quant.load import _stream
from moetune.engine.quant.stacks import (
    QuantizedStack,
    QuantReport,
    _install,
    _mark_quantized,
    _Plan,
    experts_modules,
    quantizer_for,
    stacks_of,
)
from moetune.engine.stack_files import (
    OffloadError,
    Segment,
    expert_part,
    experts_segments,
    index_dir,
    keys_of,
    read_into,
    stack_segments,
)
from moetune.engine.stored.load import (
    StackFiles,
    StoredReport,
    check_scales,
    install_stack,
    stream_all_but_stacks,
)
from moetune.model.derive import causal_lm_class, ensure_backbone

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedModel

_FILES = "_moetune_offload_files"  # on a float experts module: its stacks' _Files


def load_offloaded(
    model_dir: str | Path, mode: Mode, device: str | torch.device,
    dtype: torch.dtype = torch.bfloat16, *, experts_dtype: str = "bf16",
    double_quant: bool = False, scratch_dir: str | Path | None = None, stored: bool = False,
    part: tuple[int, int] | None = None,
) -> tuple[PreTrainedModel, ExpertStore, QuantReport | StoredReport | None]:  # fmt: skip
    """A causal LM from a local checkpoint whose expert stacks live in an ExpertStore;
    `stored`: a published quantised base, its stacks kept (and read) as the files store them;
    `part`: (rank, ranks) of train.strategy ep – the store holds experts rank·E/N …
    (rank+1)·E/N − 1 only, cut where the files hold them (stack_files.expert_part, as
    ep_load.py reads them) and never read, quantised or spilled for the other ranks."""
    if stored:
        return _load_stored(model_dir, mode, device, dtype, part)
    model, index, experts = empty_model(model_dir, dtype, "offload", "set train.offload: none")
    plans = {path: {n: stack_segments(index, path, n, tuple(m._parameters[n].shape))  # type: ignore[union-attr]
                    for n in names} for path, m, names in experts}  # type: ignore[union-attr]  # fmt: skip
    skip = keys_of(
        index, (s for stacks in plans.values() for segs in stacks.values() for s in segs)
    )
    _stream(model, Path(model_dir), {"": str(device)}, dtype, skip=skip)
    store = ExpertStore(mode, device)
    quant = _Quant(experts_dtype, double_quant) if experts_dtype != "bf16" else None
    scratch = _scratch(scratch_dir, store) if mode == "disk" and quant is not None else None
    for path, module, names in experts:
        cut = _Part(_shape(module, names[0])[0], part)
        shapes = {n: _shape(module, n) for n in names}
        sources = {n: _source(module, path, n, cut.segments(plans[path][n], shapes[n]),
                              cut.held, dtype, store, quant, scratch) for n in names}  # fmt: skip
        install(module, store, sources, names, cut.experts)
        if quant is None:  # float stacks: a balanced placement re-reads others (hold_experts)
            module.__dict__[_FILES] = _Files(plans[path], shapes, dtype)
    _finish(model, device)
    attach(model, store)
    return model, store, quant.report if quant else None


@dataclass(frozen=True)
class _Part:
    """The experts of one stack a store holds: all, or one expert-parallel rank's."""

    whole: int  # the stack's experts
    part: tuple[int, int] | None  # (rank, ranks)

    def __post_init__(self) -> None:
        # the launcher refuses such a world before; a direct call must not hold the floor
        # of E/N silently
        if self.part is not None:
            check_divides(self.whole, self.part[1])

    @property
    def held(self) -> int:
        return self.whole if self.part is None else self.whole // self.part[1]

    @property
    def experts(self) -> tuple[int, int] | None:
        """(held, whole) for `install`; None: all of them."""
        return None if self.part is None else (self.held, self.whole)

    def rows(self) -> slice:
        first = 0 if self.part is None else self.part[0] * self.held
        return slice(first, first + self.held)

    def segments(self, segments: list[Segment], shape: tuple[int, ...]) -> list[Segment]:
        return segments if self.part is None else expert_part(segments, shape, self.rows())

    def files(self, files: StackFiles) -> StackFiles:
        return files if self.part is None else files.part(*self.part)


def _shape(module: nn.Module, name: str) -> tuple[int, ...]:
    return tuple(module._parameters[name].shape)  # type: ignore[union-attr]


def empty_model(
    model_dir: str | Path, dtype: torch.dtype, what: str, fix: str
) -> tuple[Any, dict[str, Segment], list[tuple[str, nn.Module, list[str]]]]:
    """The causal LM of a local checkpoint built with meta Parameters, its files' index and
    its fused expert modules (path, module, stack names); none: refused, `what` the loader
    would have done to them."""
    # lazy: heavy to import (accelerate, transformers)
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    with init_empty_weights(include_buffers=False):
        model = ensure_backbone(causal_lm_class(config)._from_config(config, dtype=dtype))
    index = index_dir(model_dir)
    experts = list(experts_modules(model))
    if not experts:
        raise OffloadError(f"{config.model_type} has no fused expert stacks to {what}", fix)
    return model, index, experts


class _Quant:
    def __init__(self, method: str, double_quant: bool) -> None:
        backend = quantizer_for(method, double_quant=double_quant)
        self.report = QuantReport(method, double_quant, backend.name)
        self.plan = _Plan(method, double_quant, self.report, "", torch.device("cpu"), 8)


def _source(
    module: nn.Module, path: str, name: str, segments: list[Segment], held: int, dtype: torch.dtype,
    store: ExpertStore, quant: _Quant | None, scratch: Path | None,
) -> tuple[Source, torch.dtype]:  # fmt: skip
    """Where stack `name` waits – its experts that `segments` hold, `held` of them – and the
    dtype it is computed in."""
    shape = (held, *_shape(module, name)[1:])
    if quant is None:
        return _float_source(segments, shape, dtype, store), dtype
    weight = torch.empty(shape, dtype=segments[0].dtype)
    read_into(segments, weight)
    _mark_quantized(module)  # quantise on the CPU, the error measured as quant/load.py does
    _install(module, name, weight.to(dtype), replace(quant.plan, layer=path))
    stack = stacks_of(module)[name]
    source = host_source(stack, store.pin) if scratch is None else spill_source(stack, scratch)
    return source, dtype


def _float_source(
    segments: list[Segment], shape: tuple[int, ...], dtype: torch.dtype, store: ExpertStore
) -> Source:
    """A float stack's experts that `segments` hold: left in the files (disk), or read once
    into host RAM (cpu), narrowed to the compute dtype where that is smaller."""
    if store.mode == "disk":
        return FileFloat(segments, shape)  # type: ignore[return-value]  # a Source
    weight = torch.empty(shape, dtype=segments[0].dtype)
    read_into(segments, weight)
    kept = weight if weight.element_size() <= dtype.itemsize else weight.to(dtype)
    return host_source(kept, store.pin)


@dataclass(frozen=True)
class _Files:
    """Where a float experts module's stacks lie in the base's files, whole (every expert):
    what a store that is to hold other experts of them reads again (hold_experts)."""

    segments: dict[str, list[Segment]]  # stack name -> its segments, expert-major
    shapes: dict[str, tuple[int, ...]]  # stack name -> its whole shape
    dtype: torch.dtype  # computed in


def hold_experts(module: nn.Module, ids: Sequence[int]) -> None:
    """Make the store hold experts `ids` of `module`'s float stacks, in that order, read
    from the base's files as the load read its part (stack_files.experts_segments) – under
    train.ep_placement balanced, a rank's placed experts rather than its contiguous E/N
    (engine/ep_placement.py). The layer's old sources go before the new ones are read, so
    host RAM (cpu) never holds both; the store's sizes are unchanged (as many experts)."""
    files, refs = module.__dict__.get(_FILES), offloaded_of(module)
    held = next(iter(refs.values())).held if refs else None
    if files is None or held != len(ids):
        raise OffloadError(
            f"{type(module).__name__}'s store cannot hold experts {list(ids)}: its stacks are "
            f"not float stacks loaded from the base's files, {held} experts a rank",
            "place quantised or stored experts contiguously (train.ep_placement: contiguous)",
        )
    ref = next(iter(refs.values()))
    ref.store.release()  # nothing materialised keeps the experts it held
    ref.store.layers[ref.layer] = {}
    ref.store.layers[ref.layer] = {
        n: (_float_source(experts_segments(segs, files.shapes[n], ids),
                          (held, *files.shapes[n][1:]), files.dtype, ref.store), files.dtype)
        for n, segs in files.segments.items()
    }  # fmt: skip


def _scratch(scratch_dir: str | Path | None, store: ExpertStore) -> Path:
    """A scratch file for quantised stacks, removed with the store."""
    fd, name = tempfile.mkstemp(prefix="moetune-offload-", suffix=".bin", dir=scratch_dir)
    os.close(fd)
    weakref.finalize(store, _unlink, name)
    return Path(name)


def _unlink(name: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name)


def _finish(model: Any, device: str | torch.device) -> None:
    model.tie_weights()
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise OffloadError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}",
                           "point model.id at the complete model directory")  # fmt: skip
    model.to(device)
    model.eval()


@dataclass
class FileStored:
    """A published quantised stack left in the base's own files, read as stored per fetch."""

    like: QuantizedStack  # shape, layout and format; its buffers are meta
    files: StackFiles

    @property
    def nbytes(self) -> int:
        return self.files.nbytes

    def prepare(self, device: torch.device, dtype: torch.dtype,
                empty: Empty = torch.empty) -> tuple[Any, list[Piece]]:  # fmt: skip
        like, (bufs, pieces) = self.like, self.files.prepare(device, empty=empty)
        stack = QuantizedStack(like.shape, like.transposed, dtype, like.backend, bufs)
        return stack, pieces


def _load_stored(
    model_dir: str | Path, mode: Mode, device: str | torch.device, dtype: torch.dtype,
    part: tuple[int, int] | None,
) -> tuple[Any, ExpertStore, StoredReport]:  # fmt: skip
    """Stored stacks into the store: `disk` leaves them in the base's files, `cpu` reads each
    once into host RAM – either way in the stored bytes, dequantised on the device per expert;
    `part`: one expert-parallel rank's experts of every buffer only (StackFiles.part)."""
    model, stacks, report = stream_all_but_stacks(model_dir, device, dtype, keep_linears=True)
    store = ExpertStore(mode, device)
    for path, module, names in list(experts_modules(model)):
        sources: dict[str, tuple[Source, torch.dtype]] = {}
        cut = _Part(stacks[(path, names[0])].experts, part)
        for name in names:
            files = cut.files(stacks[(path, name)])
            like = install_stack(module, name, files.meta(), dtype, report)
            like.shape = (files.experts, *like.shape[1:])  # what the store holds of it
            check_scales(like, files)
            if mode == "disk":
                sources[name] = FileStored(like, files), dtype
            else:
                bufs = files.read()
                held = QuantizedStack(like.shape, like.transposed, dtype, like.backend, bufs)
                sources[name] = host_source(held, store.pin), dtype
        install(module, store, sources, names, cut.experts)
    if part is not None:
        report.float_bytes //= part[1]  # install_stack counted every expert in float
    _finish(model, device)
    attach(model, store)
    return model, store, report
