"""One small registry for every plug-in kind (rules, rungs, methods, rewards, exporters,
providers, quantisers, engine overrides, …): a name → entry mapping with a decorator to
register and a lookup whose miss is a user error naming what exists.

The module that defines a registry imports none of its plug-ins; the package's `__init__`
imports them (peft's `register_peft_method` pattern), so a plug-in is added by writing its
module and one import line, never by editing the registry.

    RUNGS: Registry[type[Rung]] = Registry("rung kind", RungError)

    @RUNGS.register("exact")
    class Exact(Rung): ...

    RUNGS.get("exact")  # -> Exact;  RUNGS.get("nope") raises RungError naming the kinds
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from moetune.errors import ConfigError, MoetuneError

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries by name; registering a name twice is a bug (it raises at import time)."""

    def __init__(self, kind: str, error: type[MoetuneError] = ConfigError) -> None:
        self.kind = kind
        self.error = error
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> T:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._entries[name] = entry
        return entry

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of `add`."""
        return lambda entry: self.add(name, entry)

    def get(self, name: str) -> T:
        """The entry, or a user error that lists the names there are."""
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "(none registered)"
            raise self.error(f"unknown {self.kind} {name!r}", f"use one of: {known}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def items(self) -> list[tuple[str, T]]:
        return sorted(self._entries.items())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)
