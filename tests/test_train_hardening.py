"""What a run does when the world misbehaves: a second writer on the same run dir, SIGTERM
mid-train, an unusable ledger path, a damaged checkpoint on --resume, a full disk."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import dump_config
from moetune.ledger import Ledger, LedgerError
from moetune.train import TrainError, train
from moetune.train.rundir.lock import hold, lock_path, read_holder
from test_train_helpers import (
    one_thread,
    reverse_rows,
    run_config,
    save_tiny_model,
    slowed,
    wait_for,
    write_jsonl,
)

STEPS, SAVE = 6, 2


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening")
    return save_tiny_model(root / "model"), write_jsonl(root / "train.jsonl", reverse_rows(20))


def _cfg(files, out: Path, **over):
    model, data = files
    return run_config(
        model, data, out, **{"max_steps": STEPS, "save_steps": SAVE, "routing_every": 0, **over}
    )


def _rows(cfg) -> list:
    return Ledger(cfg.output.ledger).read().rows


def _one_line_error(result) -> str:
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert result.exit_code != 0 and "Traceback" not in result.stderr
    assert len(lines) <= 2, result.stderr  # one message; rich may wrap a long one once
    return " ".join(lines)


def _spawn(script: str, *args: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("wb") as sink:  # a file, not a pipe: a full pipe would block the child
        return subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(script), *args],
            env=env,
            stdout=sink,
            stderr=sink,
        )


# ---------------------------------------------------------------- one writer per run dir

_HOLDER = """
import sys, time
from pathlib import Path
from moetune.train.rundir.lock import hold
with hold(Path(sys.argv[1])):
    Path(sys.argv[2]).touch()
    time.sleep(120)
"""


def test_second_writer_is_refused_naming_the_holder_and_writes_nothing(files, tmp_path):
    out = tmp_path / "run"
    cfg = _cfg(files, out)
    config = tmp_path / "run.yaml"
    config.write_text(dump_config(cfg))
    ready, log = tmp_path / "held", tmp_path / "holder.log"
    holder = _spawn(_HOLDER, str(out), str(ready), log=log)
    try:
        wait_for(ready, holder, log, timeout=60)
        result = CliRunner().invoke(app, ["train", str(config)])
    finally:
        holder.kill()
        holder.wait()
    text = _one_line_error(result)
    assert f"pid {holder.pid} on host {socket.gethostname()}" in text and str(out) in text
    assert not out.exists()  # nothing of the refused run was written
    (row,) = _rows(cfg)  # the refused attempt is ledgered, as every attempt is
    assert row.status == "failed" and f"pid {holder.pid}" in row.reason

    # the holder was killed (-9): its lock file is stale and simply taken over
    assert read_holder(lock_path(out))["pid"] == holder.pid
    with hold(out) as mine:
        assert read_holder(lock_path(out)) == mine and mine["pid"] == os.getpid()
    assert not lock_path(out).exists()  # a clean release leaves nothing behind


def test_a_held_lock_refuses_in_process_too(tmp_path):
    with hold(tmp_path / "run") as holder:
        with pytest.raises(TrainError, match=f"pid {os.getpid()} on host") as info:
            hold(tmp_path / "run").__enter__()
        assert holder["host"] in info.value.cause and "another output.dir" in info.value.fix


# ---------------------------------------------------------------- SIGTERM and the ledger

# the real CLI, as a user runs it
_TRAINER = slowed('from moetune.cli import app\napp(["train", sys.argv[1]])', pause=0.5)


def test_sigterm_mid_train_leaves_a_cancelled_row_and_a_resumable_run(files, tmp_path):
    out = tmp_path / "run"
    cfg = _cfg(files, out)
    config = tmp_path / "run.yaml"
    config.write_text(dump_config(cfg))
    log = tmp_path / "child.log"
    child = _spawn(_TRAINER, str(config), log=log)
    try:
        wait_for(out / "checkpoints" / "step-2", child, log)
        # a second, real writer while the first trains: refused, naming the trainer
        refused = CliRunner().invoke(app, ["train", str(config), "--resume"])
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=60)
    finally:
        child.kill()
        child.wait()
    assert f"pid {child.pid}" in _one_line_error(refused)
    assert child.returncode != 0 and "Traceback" not in log.read_text()
    rows = {r.status: r for r in _rows(cfg)}
    assert rows.keys() == {"failed", "cancelled"}
    assert rows["cancelled"].reason == "terminated (SIGTERM)" and rows["cancelled"].run_id == "run"
    assert not (out / "summary.json").exists() and not lock_path(out).exists()

    with one_thread():
        result = train(cfg, resume=True, progress=False)
    assert result.resumed_from_step is not None and result.resumed_from_step >= 2
    assert result.steps == STEPS and (out / "adapter" / "adapter_model.safetensors").is_file()
    assert [r.status for r in _rows(cfg)][-1] == "ok"


def test_sigterm_inside_an_attempt_is_a_cancelled_row_and_the_handler_comes_back(tmp_path):
    from moetune.ledger import Terminated, attempt

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated), attempt(tmp_path / "ledger.jsonl", "eval", run_id="r"):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # never reached: the handler raises at once
    (row,) = Ledger(tmp_path / "ledger.jsonl").read().rows
    assert (row.kind, row.status, row.reason) == ("eval", "cancelled", "terminated (SIGTERM)")
    assert row.seconds is not None and row.seconds < 5
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("where", ["a directory", "under a file"])
def test_unusable_ledger_is_refused_before_anything_is_built(files, tmp_path, where):
    blocker = tmp_path / "blocker"
    if where == "a directory":
        blocker.mkdir()
        ledger = blocker
    else:
        blocker.write_text("not a directory\n")
        ledger = blocker / "ledger.jsonl"
    out = tmp_path / "run"
    cfg = _cfg(files, out).model_copy(deep=True)
    cfg.output.ledger = str(ledger)
    with pytest.raises(LedgerError, match=f"output.ledger {ledger} "):
        train(cfg, progress=False)
    assert not out.exists()  # refused before the run dir, the model or the data

    config = tmp_path / "run.yaml"
    config.write_text(dump_config(cfg))
    text = _one_line_error(CliRunner().invoke(app, ["train", str(config)]))
    assert "output.ledger" in text and "fix:" in text and not out.exists()


# ---------------------------------------------------------------- a damaged base (issue 36 item 8)


def _damage(model: Path, how: str) -> None:
    weights = model / "model.safetensors"
    whole = weights.read_bytes()
    if how == "cut short":  # a copy that stopped part way
        weights.write_bytes(whole[: len(whole) // 2])
    elif how == "header overwritten":
        weights.write_bytes(whole[:8] + b"\x00" * 64 + whole[72:])
    else:  # "shard missing": a sharded base whose index names a file the folder lacks
        weights.rename(model / "model-00001-of-00002.safetensors")
        names = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                 "lm_head.weight": "model-00002-of-00002.safetensors"}  # fmt: skip
        index = {"metadata": {"total_size": len(whole)}, "weight_map": names}
        (model / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("how", ["cut short", "header overwritten", "shard missing"])
@pytest.mark.parametrize("offload", ["none", "disk"])
def test_a_damaged_base_is_one_line_before_the_run_dir(files, tmp_path, how, offload):
    """A damaged base safetensors was exit 3 (SafetensorError; JSONDecodeError under disk
    offload) after config.yaml, preflight.json and data.json were written."""
    import shutil

    model = shutil.copytree(files[0], tmp_path / "model")
    _damage(model, how)
    out = tmp_path / "run"
    cfg = _cfg((model, files[1]), out).model_copy(deep=True)
    cfg.train.offload = offload
    config = tmp_path / "run.yaml"
    config.write_text(dump_config(cfg))
    text = _one_line_error(CliRunner().invoke(app, ["train", str(config)]))
    assert f"base weights {model}" in text and "are damaged" in text and "fix:" in text
    assert not out.exists()  # no partial run dir
    assert _rows(cfg)[-1].status == "failed"  # the attempt is ledgered all the same


# ---------------------------------------------------------------- damaged checkpoints


def test_resume_falls_back_from_a_truncated_checkpoint_and_keeps_it(files, tmp_path):
    out = tmp_path / "run"
    cfg = _cfg(files, out)
    with one_thread():
        train(cfg, progress=False)
    (out / "summary.json").unlink()  # pretend it stopped after its last checkpoint
    latest = out / "checkpoints" / f"step-{STEPS}"
    weights = latest / "adapter_model.safetensors"
    torn = weights.read_bytes()[: weights.stat().st_size // 2]
    weights.write_bytes(torn)

    with one_thread():
        result = train(cfg, resume=True, progress=False)
    assert result.resumed_from_step == STEPS - SAVE and result.steps == STEPS
    kept = out / "checkpoints" / f"step-{STEPS}.damaged"
    assert (kept / "adapter_model.safetensors").read_bytes() == torn  # kept as it was
    (note,) = [w for w in result.warnings if "damaged" in w]
    assert f"checkpoint step {STEPS} is damaged (adapter_model.safetensors: truncated" in note
    assert f"resuming from step {STEPS - SAVE}" in note and str(kept) in note
    assert (latest / "trainer_state.json").is_file()  # the redone step is committed again


def test_truncated_optimizer_state_is_found_too(files, tmp_path):
    from moetune.train.rundir.checkpoint import RunDir
    from moetune.train.rundir.recovery import resume_point_of

    out = tmp_path / "run"
    with one_thread():
        train(_cfg(files, out, max_steps=4), progress=False)
    optimizer = out / "checkpoints" / "step-4" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:100])
    point = resume_point_of(RunDir(out))
    assert point.checkpoint == (2, out / "checkpoints" / "step-2")
    assert [(s, p) for s, _, p in point.damaged] == [
        (4, "optimizer.pt: truncated or not a torch file")
    ]


# ---------------------------------------------------------------- a full disk


def test_disk_full_while_checkpointing_is_one_line_and_keeps_the_last_checkpoint(
    files, tmp_path, monkeypatch
):
    out = tmp_path / "run"
    cfg = _cfg(files, out)
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if f"checkpoint-{2 * SAVE}" in str(f):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    with one_thread(), pytest.raises(TrainError) as info:
        train(cfg, progress=False)
    cause = info.value.cause
    assert cause.startswith(
        f"disk full while writing {out / '.staging' / f'checkpoint-{2 * SAVE}'}"
    )
    assert f"free on {out}" in cause and f"checkpoint step {SAVE} is intact" in cause
    assert "\n" not in cause and "--resume" in info.value.fix
    step = out / "checkpoints" / f"step-{SAVE}"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [step.name]
    json.loads((step / "trainer_state.json").read_text())  # whole
    assert not (out / ".staging").exists()  # the torn save is cleared, freeing its space
    assert _rows(cfg)[-1].status == "failed" and "disk full" in _rows(cfg)[-1].reason


def test_full_disk_is_recognised_however_the_writer_reports_it():
    from moetune.train.rundir.recovery import is_disk_full

    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    torch_writer = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
    rust_writer = "Error while serializing: IoError(Os { code: 28, message: No space left on device"
    assert is_disk_full(RuntimeError(torch_writer)) and is_disk_full(Exception(rust_writer))
    assert not is_disk_full(RuntimeError("PytorchStreamReader failed reading zip archive"))


def test_a_save_that_came_out_short_is_never_committed(files, tmp_path, monkeypatch):
    """torch.save's C++ writer can end a save on a full disk without an error: the file is
    simply short. Such a checkpoint must not become the one --resume trusts."""
    out = tmp_path / "run"
    cfg = _cfg(files, out)
    real_save = torch.save

    def short_write(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        if f"checkpoint-{2 * SAVE}" in str(f) and str(f).endswith("optimizer.pt"):
            Path(f).write_bytes(Path(f).read_bytes()[:64])

    monkeypatch.setattr(torch, "save", short_write)
    with one_thread(), pytest.raises(TrainError) as info:
        train(cfg, progress=False)
    assert info.value.cause.startswith(
        f"checkpoint step {2 * SAVE} came out incomplete (optimizer.pt: truncated"
    )
    assert f"checkpoint step {SAVE} is intact" in info.value.cause
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step-{SAVE}"]
