"""Opt-in (`-m interop`): `moetune export --format gguf` on an adapter of the demo base, with
llama.cpp's converter (MOETUNE_LLAMA_CPP, e.g. the llama-cpp-python sdist's vendor/llama.cpp).

The stock converter refuses the demo's character tokenizer (unknown BPE pre-tokenizer);
the export converts the base and the merged model all the same, with the vocabulary moetune
writes. Where llama-cpp-python's venv is there too (MOETUNE_LLAMACPP_PYTHON), llama.cpp
serves base.gguf + adapter.gguf and the check's floor is llama.cpp's own error on the merged
weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import pytest
from typer.testing import CliRunner

from export_fixtures import make_run
from moetune.cli import app
from moetune.demo.base import SHIPPED_DIR
from moetune.export.check import OWN_FACTOR, TOLERANCE

LLAMA_CPP = os.environ.get("MOETUNE_LLAMA_CPP", "")

pytestmark = [
    pytest.mark.interop,
    pytest.mark.filterwarnings("ignore"),
    pytest.mark.skipif(
        not (Path(LLAMA_CPP) / "convert_hf_to_gguf.py").is_file(),
        reason="needs llama.cpp's converter (MOETUNE_LLAMA_CPP=<llama.cpp dir>)",
    ),
]


def _demo_run(root: Path) -> Path:
    return make_run(root, "demo", base=SHIPPED_DIR, scale=0.1)


def test_the_demo_base_converts_and_its_floor_is_llamacpps_own_merged_error(tmp_path: Path) -> None:
    out = tmp_path / "gguf"
    args = ["export", str(_demo_run(tmp_path)), "--format", "gguf", "--out", str(out), "--json"]
    got = CliRunner().invoke(app, args)
    assert got.exit_code == 0, got.output
    doc = json.loads(got.stdout)
    assert {"adapter.gguf", "base.gguf", "merged.gguf"} <= set(doc["files"])
    base = gguf.GGUFReader(str(out / "base.gguf"))
    assert base.fields["tokenizer.ggml.pre"].contents() == "default"
    assert len(base.fields["tokenizer.ggml.tokens"].contents()) == 48
    check = doc["check"]
    if "skipped" in check:  # no llama-cpp-python venv here: converted, not served
        assert "llama.cpp is not installed here" in check["skipped"]
        return
    assert check["passed"], check["reason"]
    assert check["own_error"] is not None and check["logits_rel"] < 1e-3
    floor = max(TOLERANCE["float32"], OWN_FACTOR * check["own_error"])
    assert check["tolerance"] == pytest.approx(floor)
