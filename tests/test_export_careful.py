"""`moetune export` with train's care: every bad input is exit 2 with one line and nothing
written; one writer per --out; a full disk is one line; an interrupted export leaves
nothing or an output marked UNCHECKED that `moetune export --check-only DIR` checks."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from export_fixtures import make_run
from moetune.cli import app
from moetune.export import merged, pipeline
from moetune.export.guard import UNCHECKED, hold_out

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("careful"), "qwen3_moe-dense0")


@pytest.fixture
def run(made: Path, tmp_path: Path) -> Path:
    """A private copy of the module's run (each test may damage its own)."""
    return Path(shutil.copytree(made, tmp_path / "run", symlinks=True))


def _export(*args: str) -> tuple[int, str, str]:
    got = CliRunner().invoke(app, ["export", *args])
    return got.exit_code, got.stdout, got.stderr


def _refused(code: int, stderr: str, said: str) -> None:
    assert code == 2, stderr
    assert said in stderr and "fix:" in stderr and "unexpected" not in stderr
    assert len(stderr.strip().splitlines()) == 1 or "Traceback" not in stderr


def _left_behind(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".moetune-export"))


def _damage(adapter: Path, how: str) -> None:
    weights = adapter / "adapter_model.safetensors"
    if how == "missing":
        weights.unlink()
    elif how == "truncated":
        weights.write_bytes(weights.read_bytes()[:200])
    elif how == "random":
        weights.write_bytes(os.urandom(4096))
    else:  # a link to nowhere
        weights.unlink()
        weights.symlink_to(adapter / "gone.safetensors")


@pytest.mark.parametrize(
    ("how", "said"),
    [
        ("missing", "has no adapter_model.safetensors"),
        ("truncated", "is damaged: adapter_model.safetensors: truncated"),
        ("random", "is damaged: adapter_model.safetensors"),
        ("dangling", "is a link to nowhere"),
    ],
)
def test_a_damaged_adapter_is_refused_before_anything_is_written(
    run: Path, tmp_path: Path, how: str, said: str
) -> None:
    _damage(run / "adapter", how)
    code, _, err = _export(str(run), "--format", "merged", "--out", str(tmp_path / "m"))
    _refused(code, err, said)
    assert not (tmp_path / "m").exists() and _left_behind(tmp_path) == []


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--format", "vllm", "--vllm-layout", "sideways"], "--vllm-layout 'sideways'"),
        (["--format", "merged", "--max-shard-size", "huge"], "--max-shard-size 'huge'"),
        (["--format", "merged", "--max-shard-size", "0MB"], "must be a positive size"),
        (["--format", "merged", "--dtype", "fp8"], "--dtype 'fp8'"),
    ],
)
def test_every_choice_is_validated(run: Path, tmp_path: Path, flags: list[str], said: str) -> None:
    code, _, err = _export(str(run), *flags, "--out", str(tmp_path / "o"))
    _refused(code, err, said)
    assert "auto, fused" in err if "sideways" in said else True
    assert not (tmp_path / "o").exists()


def test_a_config_only_base_and_an_unwritable_out_are_refused(run: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    base = Path(
        json.loads((run / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    )
    shutil.copy(base / "config.json", bare / "config.json")
    code, _, err = _export(str(run), "--format", "merged", "--base", str(bare), "--out", "x")
    _refused(code, err, "has a config.json but no weights")
    for missing in ("/nonexistent/base", "./gone", "~/no/such/base"):  # was exit 3 (hub id check)
        code, _, err = _export(str(run), "--format", "merged", "--base", missing, "--out", "x")
        _refused(code, err, "does not exist")
    (tmp_path / "a-file").write_text("not a folder")
    out = tmp_path / "a-file" / "out"
    code, _, err = _export(str(run), "--format", "vllm", "--no-check", "--out", str(out))
    _refused(code, err, "cannot be written")


def test_a_second_export_to_one_out_is_refused_not_raced(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with hold_out(out):  # what a first export holds while it writes
        code, _, err = _export(str(run), "--format", "vllm", "--no-check", "--out", str(out))
    _refused(code, err, f"another moetune export is writing {out} (pid {os.getpid()})")
    assert not out.exists() and _left_behind(tmp_path) == []  # the lock is gone too


def test_a_full_disk_is_one_line_and_leaves_nothing(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*args: object) -> list[str]:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))

    monkeypatch.setattr(merged, "copy_tokenizer", full)
    code, _, err = _export(str(run), "--format", "merged", "--out", str(tmp_path / "m"))
    _refused(code, err, "disk full while writing the export to")
    assert not (tmp_path / "m").exists() and _left_behind(tmp_path) == []


def test_a_250_byte_out_name_works(run: Path, tmp_path: Path) -> None:
    out = tmp_path / ("o" * 250)
    code, _, err = _export(str(run), "--format", "vllm", "--no-check", "--out", str(out))
    assert code == 0, err
    assert (out / "adapter_model.safetensors").is_file() and (out / UNCHECKED).is_file()
    assert "--no-check" in (out / UNCHECKED).read_text()


def test_exporting_again_over_an_unchecked_export_names_check_only(
    run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "v"
    code, _, err = _export(str(run), "--format", "vllm", "--no-check", "--out", str(out))
    assert code == 0 and (out / UNCHECKED).is_file(), err
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, _, err = _export(str(run), "--format", "vllm", "--out", str(out))
    _refused(code, err, "holds an earlier export that was never checked")
    assert f"moetune export --check-only {out}" in " ".join(err.split())
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # kept as it was


@pytest.mark.parametrize("mask", [0o002, 0o027])
def test_exported_weights_follow_the_users_umask(run: Path, tmp_path: Path, mask: int) -> None:
    out = tmp_path / "v"
    before = os.umask(mask)
    try:
        code, _, err = _export(str(run), "--format", "vllm", "--no-check", "--out", str(out))
    finally:
        os.umask(before)
    assert code == 0, err
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes and set(modes.values()) == {0o666 & ~mask}, modes  # weights, record, marker
    assert out.stat().st_mode & 0o777 == 0o777 & ~mask


def _sigterm(*args: object) -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_before_the_rename_leaves_nothing(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(merged, "copy_tokenizer", _sigterm)
    code, _, err = _export(str(run), "--format", "merged", "--out", str(tmp_path / "m"))
    assert code == 143 and "nothing was written to" in err and "--resume" not in err
    assert not (tmp_path / "m").exists() and _left_behind(tmp_path) == []


def test_sigterm_during_the_check_leaves_an_unchecked_export_check_only_checks(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "m"
    with monkeypatch.context() as patch:
        patch.setattr(pipeline, "check_export", _sigterm)
        code, _, err = _export(str(run), "--format", "merged", "--out", str(out))
    assert code == 143 and f"moetune export --check-only {out}" in err and "--resume" not in err
    assert f"moetune export --check-only {out}" in (out / UNCHECKED).read_text()
    assert not (out / "check.json").exists()
    code, stdout, err = _export("--check-only", str(out), "--json")
    assert code == 0, err
    assert json.loads(stdout)["check"]["passed"] and json.loads((out / "check.json").read_text())
    assert not (out / UNCHECKED).exists()


def test_check_only_refuses_a_folder_no_export_wrote(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    code, _, err = _export("--check-only", str(tmp_path / "d"))
    _refused(code, err, "export.json: not found")
    code, _, err = _export(str(tmp_path))
    _refused(code, err, "export needs SOURCE, --format and --out")


def test_items_takes_prompt_answer_rows_and_a_missing_file_names_the_flag(
    run: Path, tmp_path: Path
) -> None:
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps({"prompt": p, "answer": "x"}) + "\n" for p in "abc"))
    args = [str(run), "--format", "merged", "--items"]
    code, stdout, err = _export(*args, str(items), "--out", str(tmp_path / "m"), "--json")
    assert code == 0, err
    assert json.loads(stdout)["check"]["items"] == 3
    for bad in (tmp_path / "none.jsonl", tmp_path / "empty.jsonl"):
        bad.touch() if bad.name == "empty.jsonl" else None
        code, _, err = _export(*args, str(bad), "--out", str(tmp_path / "n"))
        _refused(
            code, err, f"--items: data file {bad} not found" if "none" in bad.name else "is empty"
        )
        assert "--items" in err and "train_file" not in err and not (tmp_path / "n").exists()


def test_a_damaged_base_is_one_line_before_the_out_dir(run: Path, tmp_path: Path) -> None:
    """Issue 36 item 8: a base whose safetensors was cut short was exit 3 (SafetensorError)."""
    adapter_config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    base = shutil.copytree(Path(adapter_config["base_model_name_or_path"]), tmp_path / "base")
    weights = next(base.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:300])
    out = tmp_path / "o"
    code, _, err = _export(str(run), "--format", "merged", "--base", str(base), "--out", str(out))
    _refused(code, err, "are damaged")
    assert not out.exists()


def test_an_evaluated_unpromoted_adapter_is_refused_unless_unpromoted(
    run: Path, tmp_path: Path
) -> None:
    from moetune.io import adapter_digest
    from moetune.report.exports import exports_section

    verdict = {"verdict": "NO-GO", "reason": "1 of 1 rungs fail: skills (protected, Δ -0.500)",
               "adapter_sha256": adapter_digest(run / "adapter")}  # fmt: skip
    (run / "eval").mkdir()
    (run / "eval" / "verdict.json").write_text(json.dumps(verdict))
    for source in (run, run / "adapter"):  # the run dir, or its adapter/ folder
        code, _, err = _export(str(source), "--format", "merged", "--out", str(tmp_path / "o"))
        _refused(code, err, "was evaluated (NO-GO: 1 of 1 rungs fail")
        assert "--unpromoted" in err and not (tmp_path / "o").exists()
    code, out, err = _export(
        str(run), "--format", "merged", "--out", str(tmp_path / "o"), "--no-check",
        "--unpromoted", "--json",
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    assert doc["unpromoted"].startswith("exported with --unpromoted: the adapter")
    assert doc["unpromoted"] in doc["notes"]
    row = exports_section(type("Inp", (), {"run_dir": run})())["rows"][0]
    assert "NOT PROMOTED" in row["status"] and row["ok"] is False  # the report: never green
    # another adapter's verdict (retrained since) says nothing of this one: exported freely
    verdict["adapter_sha256"] = "0" * 64
    (run / "eval" / "verdict.json").write_text(json.dumps(verdict))
    code, out, err = _export(
        str(run), "--format", "merged", "--out", str(tmp_path / "o2"), "--no-check", "--json"
    )
    assert code == 0, err
    assert json.loads(out)["unpromoted"] is None
