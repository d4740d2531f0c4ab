from pathlib import Path

import pytest

from moetune.config import load_config, parse_config
from moetune.errors import ConfigError


def test_defaults_and_override() -> None:
    cfg = parse_config({"lora": {"rank": 8}}, ["train.seq_len=4096", "lora.targets=[experts]"])
    assert cfg.lora.rank == 8
    assert cfg.lora.effective_alpha == 16.0
    assert cfg.train.seq_len == 4096
    assert cfg.lora.targets == ["experts"]


def test_unknown_key_is_named(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("lora:\n  rnak: 8\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert "lora.rnak" in exc.value.cause and "unknown key" in exc.value.cause


@pytest.mark.parametrize("bad", ["lora.rank=0", "lora.rank=-4", "train.seq_len=0"])
def test_non_positive_rejected(bad: str) -> None:
    with pytest.raises(ConfigError, match="positive"):
        parse_config({}, [bad])
