"""The served == trained check's floor is the consumer's own error on the trained weights:
llama.cpp-like kernels that differ from transformers by e on the merged weights may differ by
OWN_FACTOR × e on the LoRA path, and no more (fake consumer outputs with exactly known
relative errors; no llama.cpp needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from export_fixtures import make_run
from moetune.errors import MoetuneError
from moetune.export import check
from moetune.export.check import (
    OWN_FACTOR,
    CheckOptions,
    OwnError,
    Reference,
    Served,
    compare,
)
from moetune.export.pipeline import checked
from moetune.export.registry import ExportResult
from moetune.export.source import resolve_source

pytestmark = pytest.mark.filterwarnings("ignore")


def _off_by(logits: list[torch.Tensor], eps: float, seed: int = 0) -> list[torch.Tensor]:
    """Each tensor moved by exactly `eps` relative (Frobenius) in a random direction."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for x in logits:
        u = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        out.append(x + eps * x.norm() * u / u.norm())
    return out


def _reference(n: int = 6) -> Reference:
    gen = torch.Generator().manual_seed(1)
    logits = [torch.randn(5, 64, generator=gen, dtype=torch.float64) for _ in range(n)]
    served = Served(logits, [[3, 4]] * n)
    return Reference([[1, 2]] * n, [[1]] * n, served, _off_by(logits, 1.0, seed=2))


def test_the_floor_is_the_consumers_merged_error_times_the_factor() -> None:
    ref = _reference()
    got = Served(_off_by(ref.served.logits, 2e-3), ref.served.greedy)
    # llama.cpp-like kernels: off by 1e-3 on the merged weights, so 2e-3 on the LoRA passes
    loose = compare("gguf", "fake", ref, got, "float32", 0.9, own_err=1e-3)
    assert loose.passed, loose.reason
    assert loose.tolerance == pytest.approx(OWN_FACTOR * 1e-3)
    assert loose.logits_rel == pytest.approx(2e-3) and loose.own_error == 1e-3
    # exact on the merged weights (1e-5): the dtype's 1e-4, so 2e-3 is the LoRA path's own
    tight = compare("gguf", "fake", ref, got, "float32", 0.9, own_err=1e-5)
    assert not tight.passed and tight.tolerance == pytest.approx(1e-4)
    assert "on the merged weights it differs from transformers by 1e-05" in tight.reason
    # no floor measured: the dtype's tolerance alone
    plain = compare("merged", "fake", ref, got, "float32", 0.9)
    assert not plain.passed and plain.own_error is None and plain.tolerance == 1e-4


def test_a_nan_own_error_fails_the_check() -> None:
    ref = _reference()
    got = Served(ref.served.logits, ref.served.greedy)  # exact, yet the floor is NaN
    result = compare("gguf", "fake", ref, got, "float32", 0.9, own_err=float("nan"))
    assert not result.passed and "tolerance nan" in result.reason


def test_a_dropped_expert_lora_fails_whatever_the_consumers_own_error() -> None:
    ref = _reference()
    dropped = Served(ref.without_experts, ref.served.greedy)  # what an attention-only serves
    result = compare("gguf", "fake", ref, dropped, "float32", 0.9, own_err=1e-3)
    assert not result.passed and "expert LoRA is not served" in result.reason


def _fake_consumer(lora_err: float, own_err: float, calls: list[str]) -> tuple:
    """A consumer serving the LoRA path off by `lora_err` and the merged weights off by
    `own_err` (both relative to transformers), like a stack with kernels of its own."""

    def consume(out: Path, source, sequences, prompts, new):  # type: ignore[no-untyped-def]
        ref = check.reference(source, prompts, new)
        calls.append("lora")
        return Served(_off_by(ref.served.logits, lora_err), ref.served.greedy)

    def baseline(out: Path, source, sequences):  # type: ignore[no-untyped-def]
        calls.append("merged")
        merged = [torch.randn(len(s), 8, dtype=torch.float64) for s in sequences]
        return OwnError(_off_by(merged, own_err, seed=3), merged)

    return consume, baseline


@pytest.mark.parametrize(("own_err", "passes"), [(1e-3, True), (2e-4, False)])
def test_the_check_measures_the_merged_weights_through_the_consumer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_err: float, passes: bool
) -> None:
    source = resolve_source(make_run(tmp_path, "olmoe"))
    calls: list[str] = []
    consume, baseline = _fake_consumer(2e-3, own_err, calls)
    monkeypatch.setitem(check.CONSUMERS, "fake", ("fake stack", consume))
    monkeypatch.setitem(check.BASELINES, "fake", baseline)
    out = tmp_path / "out"
    out.mkdir()
    result = ExportResult("fake", out)
    doc = {**result.to_json(), "adapter": str(source.adapter_dir), "base": source.base}
    if passes:
        checked(source, result, CheckOptions(items=4), None, doc, {})
    else:  # the LoRA path adds error beyond the consumer's own: refused, figures kept
        with pytest.raises(MoetuneError, match="on the merged weights it differs"):
            checked(source, result, CheckOptions(items=4), None, doc, {})
    assert calls == ["lora", "merged"]
    doc = json.loads((out / "check.json").read_text())
    assert doc["own_error"] == pytest.approx(own_err, rel=1e-6)
    assert doc["tolerance"] == pytest.approx(max(1e-4, OWN_FACTOR * own_err), rel=1e-6)
    assert doc["logits_rel"] == pytest.approx(2e-3, rel=1e-6)
    assert doc["passed"] is passes, doc["reason"]
