"""A base published in a format moetune cannot read is refused by `inspect`, `plan`, `lint`
and `train` alike: one line naming the format, the formats moetune reads and the fix, exit 2,
before anything is sized or loaded (no "fits", no load report, no run dir)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from moetune.cli import app
from moetune.model.tiny import TINY_CONFIGS
from test_train_helpers import reverse_rows, run_config, write_jsonl

HQQ = {"quant_method": "hqq", "nbits": 4, "group_size": 64}
UNKNOWN = {"quant_method": "made_up_4bit", "bits": 4}
BNB = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}


def _base(root: Path, qcfg: dict[str, Any]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    config = {**TINY_CONFIGS["qwen3_moe-dense0"], "quantization_config": qcfg}
    (root / "config.json").write_text(json.dumps(config))
    return root


def _run_yaml(tmp_path: Path, base: Path) -> str:
    data = write_jsonl(tmp_path / "d.jsonl", reverse_rows(8))
    cfg = run_config(base, data, tmp_path / "run", max_steps=1)
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(cfg.model_dump(mode="json")))
    return str(path)


def _invoke(command: str, target: str, *extra: str) -> Any:
    return CliRunner().invoke(app, [command, target, *extra])


# transformers' HQQ quantizer trains where the hqq library is installed: refused only without it
NO_HQQ = pytest.mark.skipif(importlib.util.find_spec("hqq") is not None, reason="hqq installed")


@pytest.mark.parametrize("qcfg", [pytest.param(HQQ, marks=NO_HQQ), UNKNOWN], ids=["hqq", "unknown"])
@pytest.mark.parametrize("command", ["inspect", "plan", "lint", "train"])
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_unreadable_format_refused_by_every_command(
    tmp_path: Path, command: str, qcfg: dict[str, Any], as_json: bool
) -> None:
    base = _base(tmp_path / "base", qcfg)
    target = _run_yaml(tmp_path, base) if command in ("lint", "train") else str(base)
    extra = ["--json"] if as_json and command != "train" else []
    result = _invoke(command, target, *extra)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert f"cannot read checkpoints quantised as {qcfg['quant_method']}" in lines[0]
    assert "fix:" in lines[0] and "block FP8" in lines[0] and "NVFP4" in lines[0]
    # no table, no "fits", no JSON plan: with --json the refusal alone, as one JSON object
    assert json.loads(result.stdout)["error"]["exit_code"] == 2 if extra else not result.stdout
    assert not (tmp_path / "run").exists()  # train wrote nothing


def test_bitsandbytes_base_still_planned(tmp_path: Path) -> None:
    """transformers' own quantizer trains it: not refused."""
    base = _base(tmp_path / "base", BNB)
    for command in ("inspect", "plan"):
        result = _invoke(command, str(base), "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)
