"""mlx-lm's backend and layout rules: MLX-NO-BACKEND, MLX-FUSED-KEYS and `moetune doctor`'s
mlx line. (The MLX probes run in tests/test_probes.py, which fails instead of skipping
them when MOETUNE_REQUIRE_MLX=1, as CI sets it.)"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import RunConfig
from moetune.lint.mlx_env import MlxBackend
from moetune.lint.registry import RULES, LintContext
from moetune.lint.rules import mlx as rules_mlx

NO_BACKEND = MlxBackend("0.32.2", None, None, None, "No module named 'mlx'")


def _check(stack: str, found: MlxBackend, monkeypatch: pytest.MonkeyPatch) -> str | None:
    monkeypatch.setattr(rules_mlx, "mlx_backend", lambda: found)
    cfg = RunConfig.model_validate({"model": {"id": "x/y"}, "lora": {"stack": stack}})
    finding = RULES.get("MLX-NO-BACKEND").check(LintContext(config=cfg, env={}, versions={}))
    return None if finding is None else f"{finding.severity}: {finding.message} | {finding.fix}"


def test_mlx_lm_without_backend_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    text = _check("mlx", NO_BACKEND, monkeypatch)
    assert text is not None and text.startswith("error: mlx-lm 0.32.2 is installed without")
    assert "No module named 'mlx'" in text and "mlx[cpu]" in text


def test_mlx_lm_absent_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    text = _check("mlx", MlxBackend(None, None, None, None, "No module named 'mlx'"), monkeypatch)
    assert text is not None and "mlx-lm is not installed" in text and "moetune[mlx]" in text


def test_backend_present_or_peft_stack_is_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (
        _check("mlx", MlxBackend("0.32.2", "0.32.4", "cpu", "Device(cpu, 0)"), monkeypatch) is None
    )
    assert _check("peft", NO_BACKEND, monkeypatch) is None


def test_installed_backend_is_detected() -> None:
    found = rules_mlx.mlx_backend()
    if found.mlx_lm is None:
        pytest.skip("mlx-lm not installed (pip install 'moetune[mlx]')")
    import mlx.core as mx

    assert found.backend in ("cpu", "metal", "cuda") and found.device == str(mx.default_device())


def test_doctor_reports_the_mlx_backend() -> None:
    result = CliRunner().invoke(app, ["doctor", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["mlx"] == rules_mlx.mlx_backend().to_json()
    plain = CliRunner().invoke(app, ["doctor"])
    found = rules_mlx.mlx_backend()
    if found.mlx_lm:
        assert f"mlx-lm {found.mlx_lm} on mlx {found.mlx}: {found.device}" in plain.stdout


def _fused_finding(model_dir: str, stack: str = "peft") -> str | None:
    cfg = RunConfig.model_validate({"model": {"id": model_dir}, "lora": {"stack": stack}})
    finding = RULES.get("MLX-FUSED-KEYS").check(LintContext(config=cfg, env={}, versions={}))
    return None if finding is None else f"{finding.severity}: {finding.message}"


def test_fused_mlx_checkpoint_is_refused_for_transformers(tmp_path) -> None:
    import torch
    from safetensors.torch import save_file

    fused, plain = tmp_path / "fused", tmp_path / "plain"
    fused.mkdir(), plain.mkdir()
    save_file({"model.layers.0.mlp.switch_mlp.up_proj.weight": torch.zeros(2, 3, 4)},
              str(fused / "model.safetensors"))  # fmt: skip
    save_file({"model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(3, 4)},
              str(plain / "model.safetensors"))  # fmt: skip
    text = _fused_finding(str(fused))
    assert text is not None and text.startswith("error:") and "switch_mlp.up_proj" in text
    assert _fused_finding(str(plain)) is None
    assert _fused_finding(str(fused), stack="mlx") is None  # mlx-lm reads its own layout
