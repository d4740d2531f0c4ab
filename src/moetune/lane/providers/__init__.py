"""Providers of pods, one module each behind the interface in `base` (registered by name;
a provider's module – and any client library it needs – is imported only when used).

`provider_class` imports the one module a name needs; `site_of` hands plan/ and lint/ the
provider's traits as plain values, so neither of them knows a provider."""

from __future__ import annotations

import importlib
import pkgutil

from moetune.lane.providers.base import PROVIDERS, Provider
from moetune.plan.cost.walls import Site


def provider_names() -> list[str]:
    """Every provider module in this package (each registers its provider by its name)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base")


def provider_class(name: str) -> type[Provider]:
    """The provider registered as `name`, its module imported now (a LaneError lists the
    known ones when there is none)."""
    if name in provider_names():
        importlib.import_module(f"{__name__}.{name}")
    return PROVIDERS.get(name)


def site_of(name: str) -> Site:
    """Where a run on provider `name` goes, as the walls and the rules see it."""
    cls = provider_class(name)
    return Site(
        remote=cls.remote,
        default_volume_gb=cls.default_volume_gb,
        default_watchdog_s=cls.default_watchdog_s,
        setup_s=cls.setup_s,
        title=cls.title,
    )
