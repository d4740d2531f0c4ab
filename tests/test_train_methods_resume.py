"""DPO and GRPO runs killed with kill -9 mid-run resume from their last whole checkpoint
and end with the adapter an uninterrupted run produces (GRPO: the same sampled rollouts,
since the RNG state rides in the checkpoint)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moetune.config import dump_config
from moetune.train import train
from test_train_helpers import (
    TRAIN_CONFIG,
    one_thread,
    run_config,
    save_tiny_model,
    slowed,
    wait_for,
    write_jsonl,
)
from test_train_methods import preference_rows, prompt_rows

STEPS, SAVE = 6, 2
METHODS = {
    "dpo": ("DPOTrainer", preference_rows, {"batch_size": 2}),
    "grpo": ("GRPOTrainer", prompt_rows,
             {"batch_size": 4, "grpo": {"num_generations": 4, "max_completion_length": 5}}),
}  # fmt: skip


def _cfg(model: Path, data: Path, out: Path, method: str):
    over = METHODS[method][2]
    return run_config(
        model, data, out, method=method, max_steps=STEPS, save_steps=SAVE, routing_every=3, **over
    )


def _kill_mid_run(cfg, trainer: str, tmp: Path) -> None:
    config = tmp / "run.yaml"
    config.write_text(dump_config(cfg))
    script = tmp / "child.py"
    script.write_text(slowed(TRAIN_CONFIG, trainer, from_step=2, pause=1.0))
    log = tmp / "child.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("wb") as sink:  # a file, not a pipe: a full pipe would block the child
        proc = subprocess.Popen(
            [sys.executable, str(script), str(config)], env=env, stdout=sink, stderr=sink
        )
    try:
        wait_for(Path(cfg.output.dir) / "checkpoints" / "step-2", proc, log)
        time.sleep(0.5)  # inside step 3: work past the checkpoint is lost
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_kill_9_then_resume_equals_an_uninterrupted_run(method, tmp_path):
    trainer, rows, _ = METHODS[method]
    model = save_tiny_model(tmp_path / "model")
    data = write_jsonl(tmp_path / "train.jsonl", rows(16))
    with one_thread():
        straight = train(_cfg(model, data, tmp_path / "straight", method), progress=False)
    killed = _cfg(model, data, tmp_path / "killed", method)
    _kill_mid_run(killed, trainer, tmp_path)
    assert not (tmp_path / "killed" / "summary.json").exists()
    with one_thread():
        resumed = train(killed, resume=True, progress=False)
    assert resumed.resumed_from_step in (2, 4) and resumed.steps == STEPS
    got = load_file(str(Path(resumed.adapter_dir) / "adapter_model.safetensors"))
    want = load_file(str(Path(straight.adapter_dir) / "adapter_model.safetensors"))
    assert got.keys() == want.keys() and any("experts" in k for k in got)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0)
