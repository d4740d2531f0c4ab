"""Resolving a model to its config.json: local dir/file, bundled catalog, hub (offline here)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from moetune.errors import ConfigError, ModelSourceError
from moetune.model import catalog_ids, catalog_meta, load_spec, resolve_config
from moetune.model.tiny import tiny_config

REQUIRED_IDS = {
    "Qwen/Qwen3-30B-A3B",
    "Qwen/Qwen3-235B-A22B",
    "allenai/OLMoE-1B-7B-0924",
    "deepseek-ai/DeepSeek-V2-Lite",
    "mistralai/Mixtral-8x7B-v0.1",
    "openai/gpt-oss-20b",
    "Qwen/Qwen1.5-MoE-A2.7B",
}


def _write(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_local_dir_with_config_json(tmp_path: Path) -> None:
    _write(tmp_path / "config.json", tiny_config("qwen3_moe-dense0"))
    name, cfg = resolve_config(str(tmp_path))
    assert name == str(tmp_path)
    assert cfg["model_type"] == "qwen3_moe"
    spec = load_spec(str(tmp_path))
    assert (spec.num_experts, spec.moe_layers, spec.total_params) == (4, (1, 2), 11168)


def test_json_file_path(tmp_path: Path) -> None:
    path = _write(tmp_path / "mixtral.json", tiny_config("mixtral"))
    assert load_spec(str(path)).total_params == 18480


def test_dir_without_config_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError) as err:
        resolve_config(str(tmp_path))
    assert str(tmp_path / "config.json") in err.value.cause
    assert "config.json" in err.value.fix


def test_missing_json_file(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="does not exist"):
        resolve_config(str(tmp_path / "nope.json"))


def test_invalid_json_names_file_and_position(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe",,}', encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        resolve_config(str(tmp_path))
    assert str(tmp_path / "config.json") in err.value.cause
    assert "line 1" in err.value.cause


def test_json_that_is_not_an_object(tmp_path: Path) -> None:
    path = _write(tmp_path / "config.json", [1, 2])
    with pytest.raises(ConfigError, match="list"):
        resolve_config(str(path))


@pytest.mark.parametrize(
    "spelling", ["Qwen/Qwen3-30B-A3B", "qwen/qwen3-30b-a3b", "Qwen3-30B-A3B", "qwen3-30b-a3b"]
)
def test_catalog_ids_match_case_insensitively_with_or_without_org(spelling: str) -> None:
    name, cfg = resolve_config(spelling)
    assert name == "Qwen/Qwen3-30B-A3B"
    assert cfg["num_experts"] == 128


def test_catalog_lists_required_models() -> None:
    ids = catalog_ids()
    assert set(ids) >= REQUIRED_IDS
    assert ids == sorted(ids)


def test_catalog_metadata_stays_out_of_hf_config() -> None:
    spec = load_spec("openai/gpt-oss-20b")
    assert "_moetune" not in spec.hf_config
    assert "quantization_config" not in spec.hf_config  # bf16 build; counts are unchanged
    assert spec.quant_method == "mxfp4"
    assert catalog_meta("gpt-oss-20b")["id"] == "openai/gpt-oss-20b"
    assert catalog_meta("not/bundled") == {}


def test_resolved_catalog_dict_is_a_private_copy() -> None:
    _, first = resolve_config("Qwen3-30B-A3B")
    first["num_experts"] = 1
    _, second = resolve_config("Qwen3-30B-A3B")
    assert second["num_experts"] == 128


def test_unknown_plain_name_lists_bundled_ids() -> None:
    with pytest.raises(ModelSourceError) as err:
        resolve_config("no-such-model")
    assert "Qwen/Qwen3-30B-A3B" in err.value.fix


def test_hub_id_offline_fails_clearly_without_network(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # nothing cached
    connects: list[object] = []

    def no_connect(self: socket.socket, address: object) -> None:
        connects.append(address)
        raise OSError("network disabled in tests")

    monkeypatch.setattr(socket.socket, "connect", no_connect)
    with pytest.raises(ModelSourceError) as err:
        resolve_config("some-org/not-bundled-moe")
    assert connects == []
    assert "some-org/not-bundled-moe" in err.value.cause
    assert "HF_HUB_OFFLINE is set" in err.value.cause
    assert err.value.fix.startswith("pass a local dir with config.json or a bundled id: ")
    assert "Qwen/Qwen3-30B-A3B" in err.value.fix


def test_hub_id_served_from_the_hub_cache_offline(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from huggingface_hub import constants

    snapshot = tmp_path / "models--some-org--cached-moe" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    _write(snapshot / "config.json", tiny_config("olmoe"))
    (tmp_path / "models--some-org--cached-moe" / "refs").mkdir()
    (tmp_path / "models--some-org--cached-moe" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    name, cfg = resolve_config("some-org/cached-moe")
    assert (name, cfg["model_type"]) == ("some-org/cached-moe", "olmoe")
