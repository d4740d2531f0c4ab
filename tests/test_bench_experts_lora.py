"""benchmarks/experts_lora.py in-process on its --quick model case: int8 and nf4 experts
with gradient checkpointing, each against peft on the float stack."""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import experts_lora as bench

ARGS = ["--quick", "--cases", "model", "--gc", "on", "--experts-dtype", "int8,nf4"]


@pytest.fixture(scope="module")
def rows() -> dict[str, dict]:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        returned = bench.main([*ARGS, "--repeats", "1", "--json"])
    assert json.loads(printed.getvalue()) == returned  # --json prints the rows as returned
    return {row["experts_dtype"]: row for row in returned}


def test_one_row_per_quantised_dtype_with_gc(rows: dict[str, dict]):
    assert set(rows) == {"int8", "nf4"}
    for row in rows.values():
        assert row["case"] == "model" and row["gc"] == "on" and row["repeats"] == 1
        assert row["baseline"] == "peft on the fp32 stack"
        for key in ("speedup", "mem_ratio", "frozen_bytes", "peft_frozen_bytes"):
            assert math.isfinite(row[key]) and row[key] > 0, key


def test_peft_baseline_is_shared(rows: dict[str, dict]):
    keys = ("peft_s", "peft_peak_extra_bytes", "peft_frozen_bytes", "peft_expert_bytes")
    assert [rows["int8"][k] for k in keys] == [rows["nf4"][k] for k in keys]


def test_split_path_matches_peft_on_the_dequantised_stacks(rows: dict[str, dict]):
    for row in rows.values():
        assert row["output_rel_diff"] < 1e-5  # same weights, only the path differs
        assert math.isfinite(row["quant_rel_diff"]) and row["quant_rel_diff"] < 1e-3


def test_frozen_bytes_shrink(rows: dict[str, dict]):
    int8, nf4 = rows["int8"], rows["nf4"]
    assert int8["expert_bytes"] < int8["peft_expert_bytes"] / 1.9
    assert nf4["expert_bytes"] < int8["expert_bytes"] / 1.7
    # the whole model's frozen bytes also hold attention and embeddings in float
    assert nf4["frozen_bytes"] < int8["frozen_bytes"] < int8["peft_frozen_bytes"] / 1.9
