"""Checkpoints and resume: a run killed mid-way (a crash in-process, and a real kill -9 of a
subprocess) resumes from its last complete checkpoint with the same data order and ends
with the adapter an uninterrupted run produces; torn saves are ignored."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from moetune.train import TrainError, train
from moetune.train import trainer as trainer_mod
from test_train_helpers import (
    TRAIN_CONFIG,
    one_thread,
    reverse_rows,
    run_config,
    save_tiny_model,
    slowed,
    wait_for,
    write_jsonl,
)

STEPS, SAVE = 8, 2


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """An uninterrupted run: the reference adapter."""
    root = tmp_path_factory.mktemp("resume")
    model = save_tiny_model(root / "model")
    data = write_jsonl(root / "train.jsonl", reverse_rows(20))
    with one_thread():
        result = train(_cfg(model, data, root / "straight"), progress=False)
    return types.SimpleNamespace(root=root, model=model, data=data, result=result)


def _cfg(model: Path, data: Path, out: Path, **over):
    return run_config(
        model, data, out, **{"max_steps": STEPS, "save_steps": SAVE, "routing_every": 3, **over}
    )


def _adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def _assert_same_adapter(run: Path, reference: Path) -> None:
    got, want = _adapter(run), _adapter(reference)
    assert got.keys() == want.keys() and any("experts" in k for k in got)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _metric_steps(run: Path) -> list[int]:
    return [row["step"] for row in _metrics(run)]


def _tear(run: Path) -> None:
    """What a kill during a save or a log write leaves behind."""
    torn = run / ".staging" / "checkpoint-6"
    torn.mkdir(parents=True, exist_ok=True)
    (torn / "adapter_model.safetensors").write_bytes(b"\x00half a file")
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 9, "lo')


class _Crash(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 5:  # after the step-4 checkpoint, before the next one
            raise RuntimeError("simulated crash")


def test_crash_then_resume_matches_an_uninterrupted_run(base, monkeypatch):
    out = base.root / "crashed"
    cfg = _cfg(base.model, base.data, out)
    real_build = trainer_mod.build_trainer

    def crashing(*args, **kwargs):
        trainer, routing = real_build(*args, **kwargs)
        trainer.add_callback(_Crash())
        return trainer, routing

    with monkeypatch.context() as mp, one_thread():
        mp.setattr(trainer_mod, "build_trainer", crashing)
        with pytest.raises(RuntimeError, match="simulated crash"):
            train(cfg, progress=False)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]
    _tear(out)

    with pytest.raises(TrainError, match=r"unfinished run \(last checkpoint: step 4\)") as info:
        train(cfg, progress=False)
    assert "--resume" in info.value.fix
    changed = _cfg(base.model, base.data, out, learning_rate=5e-3)
    with pytest.raises(TrainError, match=r"train\.learning_rate \(0\.01 -> 0\.005\)"):
        train(changed, resume=True, progress=False)

    with one_thread():
        result = train(cfg, resume=True, progress=False)
    assert result.resumed_from_step == 4 and result.steps == STEPS
    _assert_same_adapter(out, base.root / "straight")
    assert _metric_steps(out) == list(range(1, STEPS + 1))  # rows past step 4 redone once
    assert not (out / ".staging").exists()
    seen = {r["step"]: r["tokens"] for r in _metrics(base.root / "straight") if "tokens" in r}
    assert result.tokens == seen[STEPS] - seen[4]  # this attempt's tokens, for its tokens/s


def test_resume_refuses_changed_data(base, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(20))
    out = tmp_path / "run"
    cfg = _cfg(base.model, data, out, max_steps=2, routing_every=0)
    with one_thread():
        train(cfg, progress=False)
    (out / "summary.json").unlink()  # pretend it stopped before finishing
    write_jsonl(data, reverse_rows(21))
    with pytest.raises(TrainError, match="different data"):
        train(cfg, resume=True, progress=False)


# ---------------------------------------------------------------- a real kill -9


def test_kill_9_mid_run_then_resume(base, tmp_path):
    from moetune.config import dump_config

    out = tmp_path / "killed"
    cfg = _cfg(base.model, base.data, out)
    config = tmp_path / "run.yaml"
    config.write_text(dump_config(cfg))
    script = tmp_path / "child.py"
    script.write_text(slowed(TRAIN_CONFIG, from_step=4, pause=0.5))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tmp_path / "child.log"
    with log.open("wb") as sink:  # a file, not a pipe: a full pipe would block the child
        proc = subprocess.Popen(
            [sys.executable, str(script), str(config)], env=env, stdout=sink, stderr=sink
        )
    try:
        wait_for(out / "checkpoints" / "step-4", proc, log, timeout=120)
        time.sleep(0.3)  # inside step 5 or 6: work past the checkpoint is lost
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "summary.json").exists()
    _tear(out)

    with one_thread():
        result = train(cfg, resume=True, progress=False)
    assert result.resumed_from_step in (4, 6) and result.steps == STEPS
    _assert_same_adapter(out, base.root / "straight")
    assert _metric_steps(out) == list(range(1, STEPS + 1))
