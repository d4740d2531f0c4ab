"""The shared registry: lookup, the error a miss raises, double registration."""

from __future__ import annotations

import pytest

from moetune.errors import ConfigError, RecipeError
from moetune.registry import Registry


def test_register_and_get_by_name() -> None:
    reg: Registry[int] = Registry("widget")
    reg.add("b", 2)

    @reg.register("a")
    def one() -> int:
        return 1

    assert reg.names() == ["a", "b"]
    assert reg.get("b") == 2
    assert reg.get("a") is one
    assert "a" in reg and "c" not in reg
    assert list(reg) == ["a", "b"] and len(reg) == 2


def test_a_miss_names_the_known_entries_in_the_registry_error() -> None:
    reg: Registry[int] = Registry("widget", RecipeError)
    reg.add("x", 1)
    reg.add("y", 2)
    with pytest.raises(RecipeError) as err:
        reg.get("z")
    assert err.value.cause == "unknown widget 'z'"
    assert err.value.fix == "use one of: x, y"
    with pytest.raises(ConfigError):
        Registry[int]("thing").get("a")


def test_registering_a_name_twice_is_refused() -> None:
    reg: Registry[int] = Registry("widget")
    reg.add("a", 1)
    with pytest.raises(ValueError, match="registered twice"):
        reg.add("a", 2)
