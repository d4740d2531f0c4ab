"""benchmarks/gpu_validate.py on the CPU: --smoke runs tiny versions of the GPU cases.

Without an allocator to read, the measured bytes are the tracker's count of the real-tensor
step in the script's own loop, so they must equal the fake-tensor prediction byte for byte
– also after one built model is switched between engines and checkpointing settings, and
with NF4 experts quantised at build. The device run itself is not tested here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_env
import gpu_cases
import gpu_validate as gv
import moe_layer

# One build reused across an engine switch and gc on -> off, plus the NF4 build.
SMOKE_CASES = ("30b-peft-2k", "30b-moetune-2k-nogc", "30b-moetune-nf4dq-2k")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("gpu_validate")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOETUNE_CACHE_DIR", str(root / "cache"))  # no stale or shared traces
        threads = torch.get_num_threads()
        rc = gv.main(["--smoke", "--cases", ",".join(SMOKE_CASES), "--out", str(root / "out"),
                      "--record", "--results", str(root / "RESULTS.md")])  # fmt: skip
    data = json.loads((root / "out" / "gpu_validate.json").read_text())
    return {"rc": rc, "data": data, "root": root, "threads": threads}


def test_smoke_measures_every_case_byte_exact(smoke: dict[str, Any]):
    assert smoke["rc"] == 0
    rows = smoke["data"]["cases"]
    assert [r["case"] for r in rows] == list(SMOKE_CASES)
    for r in rows:
        assert r["status"] == "ok"
        assert r["predicted_bytes"] > r["weight_bytes"] > 0
        assert r["measured_bytes"] == r["tracker_bytes"] == r["predicted_bytes"]
        assert r["error"] == 0.0 and r["tracker_error"] == 0.0 and r["within_goal"]
        assert abs(r["analytic_error"]) < 0.1
        assert r["step_s"] > 0 and len(r["step_times_s"]) == 3
        assert r["tracker_peak"]["phase"] == r["predicted_peak"]["phase"]
        assert r["tracker_peak"]["at_peak"] == r["predicted_peak"]["at_peak"]
    assert rows[0]["seq_len"] == 2048 // gpu_cases.SMOKE_SEQ_DIVISOR


def test_smoke_cases_are_the_steps_they_name(smoke: dict[str, Any]):
    peft, nogc, nf4 = smoke["data"]["cases"]
    assert (peft["engine"], peft["gc"], nogc["engine"], nogc["gc"]) == (
        "peft",
        True,
        "moetune",
        False,
    )
    assert peft["experts_implementation"] != "moetune_lora"
    assert nogc["experts_implementation"] == nf4["experts_implementation"] == "moetune_lora"
    assert nogc["build_s"] == peft["build_s"]  # one build, switched
    assert nf4["weight_bytes"] < peft["weight_bytes"]  # expert stacks stored NF4
    assert nf4["trainable_params"] == peft["trainable_params"]


def test_summary_and_results_section(smoke: dict[str, Any]):
    summary = smoke["data"]["summary"]
    assert (summary["cases"], summary["ok"], summary["within_goal"]) == (3, 3, 3)
    assert summary["worst_error"] == 0.0 and summary["mean_abs_error"] == 0.0
    assert smoke["data"]["machine"]["device"] == "cpu" and smoke["data"]["smoke"]
    text = (smoke["root"] / "RESULTS.md").read_text()
    assert text.startswith(bench_env.RESULTS_HEADER)
    assert text.count(gv.SECTION) == 1
    assert "· --smoke (tiny models) · 3/3 cases ran" in text
    assert all(f"| {name} |" in text for name in SMOKE_CASES)
    md = (smoke["root"] / "out" / "gpu_validate.md").read_text()
    assert md in text


def test_smoke_leaves_torch_threads_as_they_were(smoke: dict[str, Any]):
    assert torch.get_num_threads() == smoke["threads"]


def test_record_from_appends_under_the_same_section(smoke: dict[str, Any], tmp_path: Path):
    results = tmp_path / "RESULTS.md"
    later = "\n\n## Later section\n\nx\n"
    results.write_text(bench_env.RESULTS_HEADER + f"\n{gv.SECTION}\n\nold line{later}")
    json_path = smoke["root"] / "out" / "gpu_validate.json"
    for _ in range(2):
        assert gv.main(["--record-from", str(json_path), "--results", str(results)]) == 0
    text = results.read_text()
    assert text.count(gv.SECTION) == 1 and text.count("3/3 cases ran") == 2
    mine = text[text.index(gv.SECTION) : text.index("## Later section")]
    assert "old line" in mine and mine.count("| 30b-peft-2k |") == 2
    assert text.rstrip().endswith("x")


def test_smoke_layer_table_runs_and_is_recorded_on_its_page(tmp_path: Path):
    out, results = tmp_path / "out", tmp_path / "RESULTS.md"
    argv = ["--smoke", "--cases", gv.LAYER, "--out", str(out), "--record", "--results"]
    assert gv.main([*argv, str(results)]) == 0
    data = json.loads((out / "gpu_validate.json").read_text())
    layer = data["layer_table"]
    assert layer["status"] == "ok" and layer["absent"] == {} and data["cases"] == []
    paths = [r["path"] for r in layer["rows"]]
    assert paths == ["split", "peft", "peft_unfolded", "peft_grouped_mm"]
    assert all(max(r["output_rel_diff"], r["grad_rel_diff"]) <= 1e-4 for r in layer["rows"])
    assert all(r["peak_extra_bytes"] > 0 and r["ms"] > 0 for r in layer["rows"])
    text = results.read_text()
    assert text.count(moe_layer.SECTION) == 1 and gv.SECTION not in text  # no planner case
    again = ["--record-from", str(out / "gpu_validate.json"), "--results", str(results)]
    assert gv.main(again) == 0  # only the layer table finished: still recorded
    text = results.read_text()
    assert text.count(moe_layer.SECTION) == 1 and text.count("| split | ") == 2


def test_budget_skips_cases_and_still_writes_the_json(tmp_path: Path):
    out, results = tmp_path / "out", tmp_path / "RESULTS.md"
    argv = ["--smoke", "--budget-s", "0", "--out", str(out), "--record", "--results", str(results)]
    assert gv.main(argv) == 0
    data = json.loads((out / "gpu_validate.json").read_text())
    assert [r["status"] for r in data["cases"]] == ["skipped"] * len(data["cases"])
    assert len(data["cases"]) == sum(c.default for c in gpu_cases.CASES) >= 6
    assert all(r["reason"].startswith("budget") for r in data["cases"])
    assert data["layer_table"]["status"] == "skipped"
    assert not results.exists()  # nothing finished, nothing recorded


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_without_cuda_it_says_so_in_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    assert gv.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CUDA is not available" in err and "--smoke" in err
    assert not any(tmp_path.iterdir())


def test_unknown_case_is_a_usage_error(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exc:
        gv.main(["--smoke", "--cases", "nope"])
    assert exc.value.code == 2 and "30b-peft-2k" in capsys.readouterr().err


@pytest.mark.slow
def test_trace_workers_give_the_inline_prediction(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("MOETUNE_CACHE_DIR", str(tmp_path))  # both miss: the worker traces
    case = next(c for c in gpu_cases.CASES if c.name == "olmoe-moetune-4k")
    pool = gpu_cases.Predictions([case], smoke=True, jobs=1)
    try:
        remote = pool.get(case)
    finally:
        pool.close()
    inline = gpu_cases.predict(case, smoke=True)
    assert remote.pop("trace_s") >= 0 and inline.pop("trace_s") >= 0
    assert remote == inline


class _CudaLike:
    """A device that takes the script's CUDA branches while its tensors stay on the CPU."""

    type = "cuda"

    def __str__(self) -> str:
        return "cpu"


class _Allocator:
    """Stands in for torch.cuda's memory statistics: weights + 1 MiB left over + 7 MiB peak."""

    def __init__(self, weights: int) -> None:
        self.weights, self.resets = weights, 0

    def allocated(self, *_: Any) -> int:
        return self.weights + 2**20

    def peak(self, *_: Any) -> int:
        return self.weights + 2**20 + 7 * 2**20 + self.resets  # steps differ by a byte

    def reset(self, *_: Any) -> None:
        self.resets += 1


def test_cuda_branches_turn_allocator_figures_into_a_row(monkeypatch: pytest.MonkeyPatch):
    case = next(c for c in gpu_cases.CASES if c.name == "30b-moetune-2k")
    model = gpu_cases.build(case, gpu_cases.spec_for(case, smoke=True), torch.device("cpu"))
    gpu_cases.configure(model, case)
    alloc = _Allocator(gpu_cases.weight_bytes(model))
    cuda = torch.cuda
    for name, fn in {
        "synchronize": lambda *_: None,
        "empty_cache": lambda: None,
        "reset_peak_memory_stats": alloc.reset,
        "memory_allocated": alloc.allocated,
        "max_memory_allocated": alloc.peak,
        "max_memory_reserved": lambda *_: alloc.peak() + 2**30,
        "memory_reserved": lambda *_: 2**31,
        "mem_get_info": lambda *_: (2**34, 2**34 + 2**31 + 2**29),  # 512 MiB outside torch
    }.items():
        monkeypatch.setattr(cuda, name, fn)
    meas = gpu_cases.run_case(model, case, 32, _CudaLike(), lambda step_s: step_s > 0)
    assert meas["leftover_bytes"] == 2**20
    # steps 1 and 2 count (the trace's 2 steps), less what was allocated besides the weights
    assert meas["measured_bytes"] == alloc.weights + 7 * 2**20 + 2  # resets before steps 1, 2
    assert meas["peak_steps_bytes"][2] == meas["measured_bytes"] + 1
    assert meas["non_torch_bytes"] == 2**29 and len(meas["loss"]) == 3
    assert meas["tracker_bytes"] > alloc.weights and "tracker_failed" not in meas
    pred = {
        "predicted_bytes": meas["measured_bytes"] + 100,
        "analytic_bytes": 1,
        "overhead_bytes": 5,
    }
    row = gv.compare(case, 32, pred, meas)
    assert row["error"] == pytest.approx(100 / meas["measured_bytes"])
    assert row["required_measured_bytes"] == meas["max_reserved_bytes"] + 2**29
    assert row["required_predicted_bytes"] == pred["predicted_bytes"] + 5
    machine = {"device": "NVIDIA H200", "cuda": "12.8", "date": "2026-12-01"}
    machine |= {n: "1.0" for n in ("torch", "transformers", "peft", "trl")}
    data = {"machine": machine, "summary": gv.summary([row]), "smoke": False, "wall_s": 1.0}
    text = gv.markdown({**data, "cases": [row, {"case": "x", "status": "skipped", "reason": "r"}]})
    assert "NVIDIA H200 · torch 1.0 (CUDA 12.8)" in text and "| x | skipped: r |" in text
    assert "predicted GiB" in text and f"| {row['step_s']} |" in text


@pytest.mark.parametrize("name", ["olmoe-moetune-offload-cpu-4k", "olmoe-moetune-offload-disk-4k"])
def test_offload_cases_stream_the_experts(tmp_path: Path, name: str):
    """The offload cases' smoke: experts in the store, at most two layers of them on the
    device at a time; the plan beside it where plan.offload exists."""
    out = tmp_path / "out"
    assert gv.main(["--smoke", "--cases", name, "--out", str(out)]) == 0
    (row,) = json.loads((out / "gpu_validate.json").read_text())["cases"]
    assert row["status"] == "ok" and row["offload"] == name.split("-")[3]
    assert row["experts_implementation"] == "moetune_lora"
    stats = row["offload_stats"]
    assert stats["layers"] == gpu_cases.SMOKE_COMMON["num_hidden_layers"]
    assert stats["layer_bytes"] <= stats["peak_resident_bytes"] <= 2 * stats["layer_bytes"]
    # 2 smoke layers: both stay materialised (one in use, one prefetched), so the step after
    # the warm-up's release streams each once, in its forward
    assert stats["bytes_moved"]["forward"] >= stats["stored_bytes"] > 0
    assert row["measured_bytes"] == row["weight_bytes"] + stats["peak_resident_bytes"]
    assert (row["error"] is None) == (row["predicted_bytes"] is None)
    case = next(c for c in gpu_cases.CASES if c.name == name)
    assert case.default and case.model == gpu_cases.OLMOE  # both offload cases run by default


def test_smoke_stored_bases_train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """fp8 / mxfp4 cases: written by write_stored, loaded as stored, stepped; a plan beside."""
    monkeypatch.setenv("MOETUNE_CACHE_DIR", str(tmp_path / "cache"))
    names = ("qwen3-fp8-stored-2k", "gptoss-mxfp4-stored-2k")
    rc = gv.main(["--smoke", "--cases", ",".join(names), "--out", str(tmp_path / "out"),
                  "--results", str(tmp_path / "RESULTS.md"), "--no-tracker"])  # fmt: skip
    assert rc == 0
    rows = json.loads((tmp_path / "out" / "gpu_validate.json").read_text())["cases"]
    assert [r["case"] for r in rows] == list(names)
    for r, fmt in zip(rows, ("fp8", "mxfp4"), strict=True):
        assert r["status"] == "ok", r.get("reason")
        assert r["stored"]["format"] == fmt and r["stored"]["stacks"] == 4
        assert r["stored"]["stored_bytes"] < r["stored"]["float_bytes"] / 1.9
        assert r["predicted_bytes"] > r["weight_bytes"] > 0 and r["measured_bytes"] > 0
        assert r["error"] is not None and len(r["step_times_s"]) == 3
