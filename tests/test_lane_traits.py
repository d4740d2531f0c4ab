"""Providers by traits: what the rest of moetune needs from a provider is a class-level
trait of the Provider interface, and nothing outside lane/providers/ asks for one by name."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import pytest

from moetune.config import LaneArgs, RunConfig, parse_config
from moetune.lane.providers import provider_class, provider_names, site_of
from moetune.lane.providers.base import LaneError
from moetune.plan.cost import walls

SRC = Path(__file__).resolve().parents[1] / "src" / "moetune"
NAMES = provider_names()
QUOTED = r"""["'](?:""" + "|".join(NAMES) + r""")["']"""
# A provider name compared (== / != / `in (...)`), matched (case) or used as a key ([...]).
ASKED = re.compile(
    rf"""(?:[=!]=\s*{QUOTED})|(?:{QUOTED}\s*[=!]=)|(?:\bin\s*[(\[{{][^)\]}}\n]*{QUOTED})"""
    rf"""|(?:\[\s*{QUOTED}\s*\])|(?:\bcase\s+{QUOTED})|(?:\.get\(\s*{QUOTED})"""
)


def test_every_provider_module_is_a_config_choice_and_registers_itself() -> None:
    assert sorted(get_args(LaneArgs.model_fields["provider"].annotation)) == NAMES
    for name in NAMES:
        cls = provider_class(name)
        assert cls.name == name and cls.title


def test_an_unknown_provider_lists_the_known_ones() -> None:
    with pytest.raises(LaneError) as err:
        provider_class("nimbus")
    assert "nimbus" in err.value.cause and all(n in err.value.fix for n in ("local", "ssh"))


@pytest.mark.parametrize(
    ("name", "remote", "volume", "watchdog", "setup_s"),
    [
        ("local", False, None, None, 0.0),
        ("ssh", True, None, None, 600.0),
        ("runpod", True, 40, walls.DEFAULT_WATCHDOG_S, 600.0),
        ("skypilot", True, None, None, 600.0),
    ],
)
def test_each_provider_sets_its_own_traits(
    name: str, remote: bool, volume: int | None, watchdog: int | None, setup_s: float
) -> None:
    site = site_of(name)
    assert (site.remote, site.default_volume_gb, site.default_watchdog_s, site.setup_s) == (
        remote, volume, watchdog, setup_s,
    )  # fmt: skip


def test_only_runpod_names_a_credential_and_reads_its_value(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    lane = parse_config({"lane": {"runpod": {"api_key_env": "RP_KEY"}}}).lane
    monkeypatch.setenv("RP_KEY", "rpa_" + "K" * 20)
    assert provider_class("runpod").secret_names(lane) == {"RP_KEY": "lane.runpod.api_key_env"}
    assert provider_class("runpod").secret_values(lane) == ["rpa_" + "K" * 20]
    monkeypatch.delenv("RP_KEY")
    lane.runpod.config_file = str(tmp_path / "absent.toml")
    assert provider_class("runpod").secret_values(lane) == []  # no key here: nothing to mask
    for name in ("local", "ssh", "skypilot"):
        assert provider_class(name).secret_names(lane) == {}


def test_the_launch_estimate_pays_the_providers_setup() -> None:
    from moetune.lane.launch import launch_plan

    cfg = RunConfig.model_validate({"model": {"id": "Qwen/Qwen3-30B-A3B"}})
    assert launch_plan(cfg).estimate.setup_s == 0.0
    cfg.lane.provider, cfg.lane.ssh.host = "ssh", "gpu-box"  # no host: refused (test_lane_nodes)
    assert launch_plan(cfg).estimate.setup_s == 600.0


def test_the_grep_finds_a_provider_name_compared_or_keyed() -> None:
    asked = [
        'if cfg.lane.provider == "runpod":',
        "x = provider != 'local'",
        'if name in ("ssh", "skypilot"):',
        'RATES["runpod"]',
        'case "ssh":',
        'table.get("skypilot")',
    ]
    plain = ['"""Provider `runpod`: pods."""', 'pod.lane.provider = "local"', "lane.runpod.image"]
    assert all(ASKED.search(line) for line in asked)
    assert not any(ASKED.search(line) for line in plain)


def test_no_provider_is_asked_for_by_name_outside_lane_providers() -> None:
    found = [
        f"{path.relative_to(SRC)}:{n}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        if "lane/providers" not in path.as_posix()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if ASKED.search(line)
    ]
    assert not found, "ask the provider's traits instead:\n" + "\n".join(found)
