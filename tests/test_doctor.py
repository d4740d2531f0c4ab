import json

from typer.testing import CliRunner

from moetune.cli import app
from moetune.lint.doctor import known_bad
from moetune.lint.registry import installed_versions


def _problems(versions: dict[str, str]) -> list[str]:
    return [p["message"] for p in known_bad(versions)]


def test_doctor_json_reports_installed_versions(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    result = CliRunner().invoke(app, ["doctor", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["versions"]["peft"] == installed_versions()["peft"]
    assert report["hf_hub_disable_xet"] == "1"
    assert report["free_disk_bytes"] > 0
    assert report["problems"] == []


def test_known_bad_combinations() -> None:
    assert _problems({"transformers": "5.13.0", "mlx-lm": "0.31.1"}) == [
        "transformers 5.13.0 breaks `import mlx_lm` 0.31.x"
    ]
    assert _problems({"transformers": "4.57.1", "mlx-lm": "0.30.6"}) == [
        "mlx-lm >= 0.30.6 needs transformers >= 5"
    ]
    assert _problems({"transformers": "5.24.0", "mlx-lm": "0.32.0", "peft": "0.21.2"}) == []
    assert len(_problems({"transformers": "5.24.0", "peft": "0.16.0"})) == 1
