"""The served == trained check's floor is the consumer's own base-vs-base error: a consumer
whose kernels already differ on the base alone may differ by BASE_FACTOR times that on the
adapter, and no more (fake consumer outputs with exactly known relative errors)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from export_fixtures import make_run
from moetune.export import check
from moetune.export.check import (
    BASE_FACTOR,
    CheckOptions,
    Reference,
    Served,
    check_export,
    compare,
    hf_served,
)
from moetune.export.merged import load_base
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


def test_the_floor_is_the_consumers_base_error_times_the_factor() -> None:
    ref = _reference()
    got = Served(_off_by(ref.served.logits, 2e-3), ref.served.greedy)
    # llama.cpp-like kernels: the base alone is off by 1e-3, so 2e-3 on the adapter passes
    loose = compare("gguf", "fake", ref, got, "float32", 0.9, base_err=1e-3)
    assert loose.passed, loose.reason
    assert loose.tolerance == pytest.approx(BASE_FACTOR * 1e-3)
    assert loose.logits_rel == pytest.approx(2e-3) and loose.base_error == 1e-3
    # a consumer that is exact on the base (1e-5) gets the dtype's 1e-4: 2e-3 fails
    tight = compare("gguf", "fake", ref, got, "float32", 0.9, base_err=1e-5)
    assert not tight.passed and tight.tolerance == pytest.approx(1e-4)
    assert "the base alone differs by 1e-05" in tight.reason
    # no baseline measured: the dtype's tolerance alone, as before
    plain = compare("merged", "fake", ref, got, "float32", 0.9)
    assert not plain.passed and plain.base_error is None and plain.tolerance == 1e-4


def test_a_dropped_expert_lora_fails_whatever_the_consumers_base_error() -> None:
    ref = _reference()
    dropped = Served(ref.without_experts, ref.served.greedy)  # what an attention-only serves
    result = compare("gguf", "fake", ref, dropped, "float32", 0.9, base_err=1e-3)
    assert not result.passed and "expert LoRA is not served" in result.reason


def _fake_consumer(adapter_err: float, base_err: float, calls: list[str]) -> tuple:
    """A consumer serving the adapter off by `adapter_err` and the base off by `base_err`
    (both relative to what transformers gives), like a stack with kernels of its own."""

    def consume(out: Path, source, sequences, prompts, new):  # type: ignore[no-untyped-def]
        ref = check.reference(source, prompts, new)
        calls.append("adapter")
        return Served(_off_by(ref.served.logits, adapter_err), ref.served.greedy)

    def baseline(out: Path, source, sequences):  # type: ignore[no-untyped-def]
        calls.append("base")
        base = load_base(source.base, torch.float32).eval()
        return _off_by(hf_served(base, sequences, [], 0).logits, base_err, seed=3)

    return consume, baseline


@pytest.mark.parametrize(("base_err", "passes"), [(1e-3, True), (2e-4, False)])
def test_check_export_measures_the_base_through_the_consumer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, base_err: float, passes: bool
) -> None:
    source = resolve_source(make_run(tmp_path, "olmoe"))
    calls: list[str] = []
    consume, baseline = _fake_consumer(2e-3, base_err, calls)
    monkeypatch.setitem(check.CONSUMERS, "fake", ("fake stack", consume))
    monkeypatch.setitem(check.BASELINES, "fake", baseline)
    result = check_export(source, "fake", tmp_path, "float32", CheckOptions(items=4))
    assert calls == ["adapter", "base"]
    # the reference's base is the adapter switched off: it matches the plain base, so the
    # measured base error is the fake stack's own 1e-3 / 2e-4, not the adapter's effect
    assert result.base_error == pytest.approx(base_err, rel=1e-6)
    assert result.tolerance == pytest.approx(max(1e-4, BASE_FACTOR * base_err), rel=1e-6)
    assert result.passed is passes, result.reason
    assert result.logits_rel == pytest.approx(2e-3, rel=1e-6)
