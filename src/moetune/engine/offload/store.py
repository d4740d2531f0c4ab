"""Frozen expert stacks kept off the device (train.offload cpu | disk), streamed a layer at a time.

Each fused experts module's stacks (float, or int8 / NF4 `QuantizedStack`s) leave the module
for an `ExpertStore`: `cpu` holds them in host RAM (pinned when the device is CUDA), `disk`
leaves them in the base's safetensors files (or, quantised, in a scratch file) and reads them
by offset (engine/stack_files.py). The split-LoRA forward asks the store for a layer's
stacks when it needs them (`StackRef.fetch`); the store materialises that layer on the device,
starts reading the next one on a side thread (a side CUDA stream for the copy), and drops
every other layer – so at most two layers of experts are on the device at any moment.

Backward needs the weights again for the input gradient: the streaming autograd Function
(experts_lora `_StreamedGroupedLinear`) saves no weight, only its `StackRef`, and fetches
again; with gradient checkpointing the recompute and the backward of a layer share one fetch.
Going up the layers the store prefetches the next one, going down the previous one, and
at either end it turns around (the backward starts where the forward ended).

The store counts what it materialises: device bytes alive (each tensor's release is seen
by a `weakref.finalize`, so a weight something else kept alive still counts), its peak, and
bytes moved and read per phase (forward, recompute – a forward inside a backward – and
backward). FSDP2's `CPUOffloadPolicy` and ZeRO-Infinity offload whole parameter groups,
LoRA and optimizer state with them, and need CUDA (and libaio):
benchmarks/results/offload-and-stored.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from moetune.engine.direct_io import DirectReader, Piece
from moetune.engine.offload.sources import (
    Empty,
    HostBuffers,
    Source,
    Weight,
    host_source,
    spill_source,
)
from moetune.engine.quant.stacks import (
    QUANTIZED,
    QuantizedStack,
    experts_modules,
    is_transposed,
    stacks_of,
)
from moetune.engine.quant.stacks import peft_targets as quant_targets
from moetune.engine.stack_files import OffloadError

Mode = Literal["cpu", "disk"]
PHASES = ("forward", "recompute", "backward")
OFFLOADED = "_moetune_offloaded"  # on an experts module: {parameter name: StackRef}
_ORDER = "_moetune_offload_order"  # its stacks' parameter names in the float module's order
_STORE = "_moetune_offload_store"  # on the model: its ExpertStore


# ---------------------------------------------------------------- the store


@dataclass
class OffloadStats:
    """What the store measured; bytes_moved/bytes_read by phase."""

    mode: str
    layers: int = 0
    layer_bytes: int = 0  # the largest layer's stored bytes
    stored_bytes: int = 0  # all layers
    resident_bytes: int = 0  # materialised on the device now
    peak_resident_bytes: int = 0
    fetches: int = 0  # layer materialisations
    waits: int = 0  # of them, read in the foreground (not prefetched in time)
    load_s: float = 0.0  # seconds spent materialising layers (reads and widening), any thread
    wait_s: float = 0.0  # of the compute thread, blocked on the store: what the stream costs
    bytes_moved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    bytes_read: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PHASES, 0))

    def to_json(self) -> dict[str, Any]:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()}


MMAP_THRESHOLD = 4 << 20  # bytes: larger blocks are mapped, and unmapped when freed


def fixed_mmap_threshold() -> bool:
    """glibc raises its mmap threshold to the largest block freed (up to 32 MiB): from then on
    the per-expert float weights a streamed step dequantises (tens of MiB each, freed at once)
    come from the heap and fragment it – +0.9 GiB of peak RSS on the 27-layer FP8 disk run
    (benchmarks/results/offload-and-stored.md). A fixed threshold maps and unmaps them.
    Whether it was set (glibc only)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, MMAP_THRESHOLD))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc (macOS, musl): its own allocator's policy
        return False


class ExpertStore:
    """The offloaded stacks of every layer, materialised one layer (plus the next) at a time."""

    def __init__(self, mode: Mode, device: torch.device | str) -> None:
        self.mode, self.device = mode, torch.device(device)
        self.pin = self.device.type == "cuda"
        self.layers: list[dict[str, tuple[Source, torch.dtype]]] = []
        self.stats = OffloadStats(mode)
        self._live: dict[int, dict[str, Weight]] = {}
        self._pending: tuple[int, Future[dict[str, Weight]], str] | None = None
        self._current, self._step = -1, 1
        self._lock, self._count_lock = threading.RLock(), threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="moetune-offload")
        self.reader = DirectReader()  # its own workers: a prefetch never queues behind a load
        self.buffers = HostBuffers()
        self.empty: Empty = self.buffers.empty if self.device.type == "cpu" else torch.empty
        self._side = torch.cuda.Stream(self.device) if self.pin else None
        weakref.finalize(self, self._pool.shutdown, wait=False)
        fixed_mmap_threshold()

    def add_layer(self, sources: dict[str, tuple[Source, torch.dtype]]) -> int:
        self.layers.append(sources)
        size = sum(s.nbytes for s, _ in sources.values())
        self.stats.layers = len(self.layers)
        self.stats.stored_bytes += size
        self.stats.layer_bytes = max(self.stats.layer_bytes, size)
        return len(self.layers) - 1

    def fetch(self, layer: int, name: str, backward: bool = False) -> Weight:
        """Stack `name` of `layer` on the device; materialises the layer if it is not."""
        with self._lock:
            if layer not in self._live or layer != self._current:
                start = time.perf_counter()
                self._advance(layer, _phase(backward))
                self.stats.wait_s += time.perf_counter() - start
            return self._live[layer][name]

    def wait_prefetch(self) -> None:
        """Block until the read in flight (if any) has landed; it stays the prefetch."""
        pending = self._pending
        if pending is not None:
            pending[1].result()

    def reset_peak(self) -> None:
        with self._count_lock:
            self.stats.peak_resident_bytes = self.stats.resident_bytes

    def release(self) -> None:
        """Drop everything materialised (end of training; the next fetch reloads)."""
        with self._lock:
            self._drain()
            self._live.clear()
            self._current = -1
            self.buffers.clear()  # the host memory they held goes back too

    def _advance(self, layer: int, phase: str) -> None:
        step = layer - self._current if self._current >= 0 and layer != self._current else 0
        self._step = (1 if step > 0 else -1) if step else self._step
        self._current = layer
        ready = self._drain(keep=layer)
        for other in [k for k in self._live if k != layer]:
            del self._live[other]  # dropped: its tensors go when the last use ends
        if ready is not None:
            self._live[layer] = ready
        elif layer not in self._live:
            self.stats.waits += 1
            self._live[layer] = self._load(layer, phase)
            if self._side is not None:  # copied on the side stream here too
                _join_stream(self._live[layer], self._side)
        ahead = self._ahead(layer)
        if ahead is not None and ahead not in self._live:
            self._pending = (ahead, self._pool.submit(self._load, ahead, phase), phase)

    def _ahead(self, layer: int) -> int | None:
        """The layer the next fetch will want: one further the way we go, else back."""
        for nxt in (layer + self._step, layer - self._step):
            if 0 <= nxt < len(self.layers):
                return nxt
        return None

    def _drain(self, keep: int = -1) -> dict[str, Weight] | None:
        """Wait for the prefetch in flight; its layer if it is `keep`, else dropped."""
        if self._pending is None:
            return None
        layer, future, _ = self._pending
        self._pending = None
        weights = future.result()
        if layer != keep:
            return None
        if self._side is not None:
            _join_stream(weights, self._side)
        return weights

    def _load(self, layer: int, phase: str) -> dict[str, Weight]:
        """Materialise one layer's stacks (runs on the side thread when prefetching)."""
        out, moved, pieces, start = {}, 0, list[Piece](), time.perf_counter()
        with torch.cuda.stream(self._side) if self._side is not None else _nothing():
            for name, (source, dtype) in self.layers[layer].items():
                out[name], more = source.prepare(self.device, dtype, self.empty)
                pieces, moved = pieces + more, moved + source.nbytes
            read = self.reader.read(pieces)  # the whole layer's reads at once, in flight
        for weight in out.values():
            self._count(weight)
        with self._count_lock:
            self.stats.fetches += 1
            self.stats.bytes_moved[phase] += moved
            self.stats.bytes_read[phase] += read
            self.stats.load_s += time.perf_counter() - start
        return out

    def _count(self, weight: Weight) -> None:
        for t in _tensors(weight):
            with self._count_lock:
                self.stats.resident_bytes += t.nbytes
                peak = max(self.stats.peak_resident_bytes, self.stats.resident_bytes)
                self.stats.peak_resident_bytes = peak
            weakref.finalize(t, self._uncount, t.nbytes)

    def _uncount(self, nbytes: int) -> None:
        with self._count_lock:
            self.stats.resident_bytes -= nbytes


def _phase(backward: bool) -> str:
    if backward:
        return "backward"
    return "recompute" if torch._C._current_graph_task_id() != -1 else "forward"


def _tensors(weight: Weight) -> list[torch.Tensor]:
    return list(weight.buffers()) if isinstance(weight, QuantizedStack) else [weight]


def _join_stream(weights: dict[str, Weight], side: Any) -> None:
    """The compute stream waits for the side stream's copies, which it now owns."""
    current = torch.cuda.current_stream()
    current.wait_stream(side)
    for weight in weights.values():
        for t in _tensors(weight):
            t.record_stream(current)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# ---------------------------------------------------------------- on the model


@dataclass(frozen=True)
class StackRef:
    """One offloaded stack as its experts module sees it."""

    store: ExpertStore
    layer: int
    name: str
    shape: tuple[int, int, int]
    dtype: torch.dtype
    quantized: bool
    transposed: bool
    held: int  # experts the store holds: shape[0], or one rank's E/N (train.strategy ep)

    def fetch(self, backward: bool = False) -> Weight:
        return self.store.fetch(self.layer, self.name, backward)


class _OffloadedExperts(nn.Module):
    """Mixed into an experts module's class once its stacks are offloaded."""

    def __getattr__(self, name: str) -> Any:
        refs = self.__dict__.get(OFFLOADED)
        # a stand-in Parameter (peft_targets) first; else stock forwards: the whole stack
        if refs is not None and name in refs and name not in self.__dict__["_parameters"]:
            w = refs[name].fetch()
            return w.dequantize() if isinstance(w, QuantizedStack) else w
        return super().__getattr__(name)


_CLASSES: dict[type, type] = {}


def offloaded_of(module: nn.Module) -> dict[str, StackRef]:
    refs = module.__dict__.get(OFFLOADED)
    return refs if isinstance(refs, dict) else {}


def offloaded_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(module.stack name, tensor) of every offloaded stack, fetched one at a time (the
    store drops the layers behind it); a quantised stack dequantised – for checks that
    must see the frozen weights the model's parameters no longer hold."""
    for prefix, module in model.named_modules():
        for name, ref in offloaded_of(module).items():
            weight = ref.fetch()
            dense = weight.dequantize() if isinstance(weight, QuantizedStack) else weight
            yield f"{prefix}.{name}", dense


def store_of(model: nn.Module) -> ExpertStore | None:
    for module in model.modules():
        store = module.__dict__.get(_STORE)
        if isinstance(store, ExpertStore):
            return store
    return None


def attach(model: nn.Module, store: ExpertStore) -> None:
    model.__dict__[_STORE] = store


def mark_offloaded(module: nn.Module, refs: dict[str, StackRef], order: list[str]) -> None:
    """Hand `refs` to the module; its Parameters / quantised stacks of those names go."""
    cls = type(module)
    if not issubclass(cls, _OffloadedExperts):
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"Offloaded{cls.__name__}", (_OffloadedExperts, cls), {})
        module.__class__ = _CLASSES[cls]
    for name in refs:
        module._parameters.pop(name, None)
        quantized = module._modules.get(QUANTIZED)
        if quantized is not None and name in quantized._modules:
            del quantized._modules[name]
    module.__dict__[OFFLOADED] = refs
    module.__dict__[_ORDER] = order


def offload_experts_(model: nn.Module, mode: Mode, device: torch.device | str, *,
                     scratch: Path | None = None) -> ExpertStore:  # fmt: skip
    """Move every fused experts module's stacks of an in-memory model into a store.

    cpu: copies in host RAM; disk: written to `scratch` (a base loaded from its files goes
    through offload/load.py's load_offloaded instead, which reads the files where they are).
    """
    scratch = scratch if mode == "disk" else None
    if mode == "disk" and scratch is None:
        raise OffloadError("disk offload of an in-memory model needs a scratch file",
                           "pass scratch=Path(...)")  # fmt: skip
    store = ExpertStore(mode, device)
    for _, module, names in list(experts_modules(model)) + _quantized_only(model):
        weights: dict[str, Weight] = {n: module._parameters[n] for n in names}  # type: ignore[misc]
        weights |= stacks_of(module)
        order = [*names, *(n for n in stacks_of(module) if n not in names)]
        sources = {n: (_held(w, store, scratch), w.dtype) for n, w in weights.items()}
        install(module, store, sources, order)
    if not store.layers:
        raise OffloadError("the model has no fused 3-D expert stacks to offload",
                           "use an MoE family with fused experts (transformers 5.x)")  # fmt: skip
    attach(model, store)
    return store


def _held(weight: Weight, store: ExpertStore, scratch: Path | None) -> Source:
    return spill_source(weight, scratch) if scratch is not None else host_source(weight, store.pin)


def _quantized_only(model: nn.Module) -> list[tuple[str, nn.Module, list[str]]]:
    """Experts modules whose stacks are all quantised (experts_modules sees no float stack)."""
    found: list[tuple[str, nn.Module, list[str]]] = []
    for path, module in model.named_modules():
        floats = any(w.ndim == 3 for w in module.parameters(recurse=False))
        if stacks_of(module) and not floats:
            found.append((path, module, []))
    return found


def install(module: nn.Module, store: ExpertStore, sources: dict[str, tuple[Source, torch.dtype]],
            order: list[str], experts: tuple[int, int] | None = None) -> None:  # fmt: skip
    """Register one experts module's stacks as a store layer and hand it the refs;
    `experts`: (held, whole) where the store holds one rank's part of the stacks (the refs
    keep the whole shape: peft sizes every expert's LoRA from it)."""
    stacks = stacks_of(module)
    layer = store.add_layer(sources)
    refs = {}
    for name, (_, dtype) in sources.items():
        like = stacks.get(name)
        whole, *rest = like.shape if like is not None else tuple(getattr(module, name).shape)
        held, whole = experts or (whole, whole)
        shape = (whole, *rest)
        refs[name] = StackRef(store, layer, name, shape, dtype, like is not None,  # type: ignore[arg-type]
                              is_transposed(module), held)  # fmt: skip
    mark_offloaded(module, refs, order)


@contextlib.contextmanager
def peft_targets(model: nn.Module) -> Iterator[None]:
    """quant.peft_targets, and stand-in Parameters for offloaded stacks: call get_peft_model
    inside, so peft's `target_parameters` find them (zero storage, their shape and dtype)."""
    added = []
    for module in model.modules():
        refs = offloaded_of(module)
        for name in module.__dict__.get(_ORDER, []):
            ref = refs[name]
            empty = torch.zeros((), dtype=ref.dtype, device=ref.store.device).expand(ref.shape)
            module._parameters[name] = nn.Parameter(empty, requires_grad=False)
            added.append((module, name))
    try:
        with quant_targets(model):
            yield
    finally:
        for module, name in added:
            module._parameters.pop(name, None)
