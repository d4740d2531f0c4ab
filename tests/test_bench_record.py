"""The section writers of benchmarks/planner_accuracy.py and experts_lora.py: one dated line
lands at the end of the benchmark's own section of its results page – through bench_env's
one `append_to_section` – with every other section and recorded line kept as it was."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import experts_lora
import planner_accuracy

SUMMARY = {"date": "2026-12-06", "machine": "x86_64", "versions": "torch 2.13", "grid": "quick",
           "seqs": [512], "cases": 3, "worst_error": -0.031, "worst_case": "demo seq 512",
           "mean_abs_error": 0.012, "within_10pct": 3}  # fmt: skip


def _page(tmp_path: Path, section: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(f"# Results\n\n{section}\n\nabout\n\n- old line\n\n## Later\n\n- later line\n")
    return page


def test_planner_accuracy_records_in_its_section(tmp_path: Path, monkeypatch) -> None:
    page = _page(tmp_path, planner_accuracy.SECTION)
    monkeypatch.setattr(planner_accuracy, "RESULTS", page)
    planner_accuracy.record(SUMMARY)
    line = planner_accuracy.result_line(SUMMARY)
    assert page.read_text() == (
        f"# Results\n\n{planner_accuracy.SECTION}\n\nabout\n\n- old line\n\n{line}\n\n"
        "## Later\n\n- later line\n"
    )


def test_experts_lora_records_its_rows_in_its_section(tmp_path: Path, monkeypatch) -> None:
    page = _page(tmp_path, experts_lora.SECTION)
    monkeypatch.setattr(experts_lora, "RESULTS", page)
    monkeypatch.setattr(experts_lora, "describe", lambda row: row["text"])
    experts_lora.record([{"text": "a"}, {"text": "b"}], torch.device("cpu"), torch.float32, True)
    text = page.read_text()
    head, later = text.split("## Later")
    new = [ln for ln in head.splitlines() if ln.endswith(" · a") or ln.endswith(" · b")]
    assert len(new) == 2 and all(ln.startswith("- ") and "--quick" in ln for ln in new)
    assert head.index("- old line") < head.index(new[0]) and later == "\n\n- later line\n"


def test_a_missing_page_gets_the_header_and_the_section(tmp_path: Path, monkeypatch) -> None:
    page = tmp_path / "new.md"
    monkeypatch.setattr(planner_accuracy, "RESULTS", page)
    planner_accuracy.record(SUMMARY)
    text = page.read_text()
    assert text.startswith("# Benchmark results") and planner_accuracy.SECTION in text
    assert text.rstrip().endswith(planner_accuracy.result_line(SUMMARY))
