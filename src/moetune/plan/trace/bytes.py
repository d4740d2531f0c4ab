"""Live tensor-byte accounting at the aten dispatch level.

`ByteTracker` is a `TorchDispatchMode`: every op's output storage is counted once (keyed by
the C++ storage address, so views and re-wrapped Python objects never count twice) and
uncounted when its storage dies. It works the same on real and fake tensors, which is what
makes a fake trace byte-exact against a real run: both are measured at the same level,
above any kernel or allocator.

Categories are assigned after the step, from what each storage turned out to be (a
parameter, a `.grad`, an optimizer state tensor, or anything else), then summed over the
storages live at the peak. Each allocation and free ticks one clock, so "live at the peak"
is exact: alloc_tick <= peak_tick < free_tick.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

FROZEN = "frozen_weights"
TRAINABLE = "trainable_weights"
GRADIENTS = "gradients"
OPTIMIZER = "optimizer_state"
ACTIVATIONS = "activations"
CATEGORIES = (FROZEN, TRAINABLE, GRADIENTS, OPTIMIZER, ACTIVATIONS)

_ALIVE = 1 << 62
_DEVICE_QUERY = torch.ops.prim.device.default  # free tick of a storage that is still live


@dataclass(frozen=True)
class Peak:
    """The highest live-byte count seen, and where it happened."""

    bytes: int
    op: str
    phase: str
    step: int
    tick: int


def _tensors(out: Any) -> Iterable[torch.Tensor]:
    """Tensors in an op's output: a tensor, or (nested) tuples/lists of them."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for item in out:
            yield from _tensors(item)


class ByteTracker(TorchDispatchMode):
    """Counts live storage bytes produced by aten ops; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "setup"
        self.step = 0
        self.last_op: object = None  # the op running (or last run): names a failure
        self.live_bytes = 0
        self.peak = Peak(0, "", "", 0, 0)
        self._tick = 0
        self.ops = 0  # aten ops dispatched: what a fake trace's time grows with
        self._live: dict[int, int] = {}  # storage _cdata -> index in the log
        self._nbytes: list[int] = []  # the log: one entry per storage ever counted
        self._born: list[int] = []
        self._died: list[int] = []
        self._category: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is _DEVICE_QUERY:  # most dispatches under fake tensors; allocates nothing
            device = getattr(args[0], "fake_device", None)
            return device if device is not None else func(*args)
        self.last_op = func
        self.ops += 1
        out = func(*args, **(kwargs or {}))
        grew = False
        for tensor in _tensors(out):
            grew |= self._add(tensor.untyped_storage(), ACTIVATIONS)
        if grew and self.live_bytes > self.peak.bytes:
            self.peak = Peak(self.live_bytes, str(func), self.phase, self.step, self._tick)
        return out

    def register(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """Count storages that already exist (parameters, buffers) under `category`.

        Without this, a storage first seen as the output of a re-wrapping op (peft's
        parametrization of expert stacks) would look like a fresh allocation.
        """
        for tensor in tensors:
            self._add(tensor.untyped_storage(), category)
        if self.live_bytes > self.peak.bytes:
            self.peak = Peak(self.live_bytes, "<registered>", self.phase, self.step, self._tick)

    def _add(self, storage: torch.UntypedStorage, category: str) -> bool:
        key = storage._cdata
        if key in self._live:
            return False
        nbytes = storage.nbytes()
        self._tick += 1
        self._live[key] = len(self._nbytes)
        self._nbytes.append(nbytes)
        self._born.append(self._tick)
        self._died.append(_ALIVE)
        self._category.append(category)
        self.live_bytes += nbytes
        weakref.finalize(storage, self._free, key).atexit = False  # nothing to count at exit
        return True

    def _free(self, key: int) -> None:
        index = self._live.pop(key, None)
        if index is None:
            return
        self._tick += 1
        self._died[index] = self._tick
        self.live_bytes -= self._nbytes[index]

    def classify(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """Label the live storages of `tensors` (e.g. `.grad`s after the step) as `category`."""
        for tensor in tensors:
            index = self._live.get(tensor.untyped_storage()._cdata)
            if index is not None:
                self._category[index] = category

    def at_peak(self) -> dict[str, int]:
        """Bytes live at the peak, summed by category; the values sum to the peak."""
        totals = dict.fromkeys(CATEGORIES, 0)
        tick = self.peak.tick
        for nbytes, born, died, category in zip(
            self._nbytes, self._born, self._died, self._category, strict=True
        ):
            if born <= tick < died:
                totals[category] += nbytes
        return totals
