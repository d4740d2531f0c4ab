"""The pieces around the trainer: metrics rows, the progress bar, the run dir's files."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from rich.console import Console

from moetune.config import dump_config, parse_config
from moetune.io import atomic_write_text
from moetune.train.callbacks import MetricsCallback, RichProgress, human_bytes, rate_text
from moetune.train.errors import TrainError
from moetune.train.offload import StoreMeter
from moetune.train.rundir.checkpoint import JsonlLog, config_diff, replace_dir

ARGS = SimpleNamespace(should_save=True)


def _state(step: int, tokens: int) -> SimpleNamespace:
    return SimpleNamespace(
        global_step=step, num_input_tokens_seen=tokens, max_steps=4, is_world_process_zero=True
    )


def test_metrics_rows_carry_loss_lr_throughput_and_aux_loss():
    clock = iter([100.0, 102.0, 103.0])
    rows: list[dict] = []
    metrics = MetricsCallback(rows.append, clock=lambda: next(clock))
    metrics.on_train_begin(ARGS, _state(0, 0), None)
    metrics.on_log(ARGS, _state(1, 400), None, logs={"loss": 2.5, "learning_rate": 1e-3})
    metrics.on_log(ARGS, _state(2, 500), None, logs={"loss": 2.0, "aux_loss": 1.9})
    metrics.on_log(ARGS, _state(2, 500), None, logs={"eval_loss": 2.2})
    metrics.on_log(ARGS, _state(2, 500), None, logs={"train_runtime": 3.0})  # end summary
    assert [r["step"] for r in rows] == [1, 2, 2]
    assert rows[0]["tokens_per_s"] == 200.0 and rows[0]["lr"] == 1e-3
    assert rows[1]["tokens_per_s"] == 100.0 and rows[1]["aux_loss"] == 1.9
    assert rows[2] == {"step": 2, "eval_loss": 2.2}
    assert rows[0]["memory_bytes"] > 0


@pytest.mark.parametrize("logs", [{"loss": float("nan")}, {"eval_loss": float("inf")}])
def test_a_non_finite_loss_stops_the_run_after_recording_its_row(logs):
    rows: list[dict] = []
    metrics = MetricsCallback(rows.append)
    metrics.on_train_begin(ARGS, _state(0, 0), None)
    metrics.on_log(ARGS, _state(1, 10), None, logs={"loss": 2.0})
    with pytest.raises(TrainError) as err:
        metrics.on_log(ARGS, _state(2, 20), None, logs=logs)
    assert "at step 2: the run diverged" in err.value.cause and err.value.exit_code == 2
    assert [r["step"] for r in rows] == [1, 2]  # the diverged row is on record


def test_progress_bar_shows_loss_throughput_and_memory():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    metrics = MetricsCallback(lambda row: None)
    bar = RichProgress(metrics, console)
    bar.on_train_begin(ARGS, _state(0, 0), None)
    metrics.last = {"loss": 1.23456, "tokens_per_s": 1500.0, "memory_bytes": 3 * 2**30}
    bar.on_log(ARGS, _state(1, 10), None)
    bar.on_step_end(ARGS, _state(1, 10), None)
    bar.close()
    text = out.getvalue()
    assert "loss 1.2346" in text and "1,500 tok/s" in text and "3.0 GiB" in text
    assert "1/4" in text
    quiet = RichProgress(metrics, Console(file=io.StringIO(), quiet=True))
    quiet.on_train_begin(ARGS, _state(0, 0), None)
    assert quiet.progress is None  # progress=False draws nothing


def test_slow_steps_show_decimals_and_seconds_per_step():
    """A 41 s offload step of 128 tokens is 3.12 tok/s, not "0 tok/s", and says s/step."""
    clock = iter([0.0, 82.0, 83.0, 1000.0])
    rows: list[dict] = []
    metrics = MetricsCallback(rows.append, clock=lambda: next(clock))
    metrics.on_train_begin(ARGS, _state(0, 0), None)
    metrics.on_log(ARGS, _state(2, 256), None, logs={"loss": 2.0})
    metrics.on_log(ARGS, _state(3, 256 + 2000), None, logs={"loss": 1.9})
    assert (rows[0]["tokens_per_s"], rows[0]["step_seconds"]) == (3.12, 41.0)
    assert (rows[1]["tokens_per_s"], rows[1]["step_seconds"]) == (2000.0, 1.0)
    metrics.on_train_end(ARGS, _state(3, 2256), None)
    assert metrics.loop["tokens_per_s"] == 2.26  # the whole loop's rate: not rounded to 2.3
    assert rate_text(3.12, 41.0) == "3.12 tok/s · 41.0 s/step"
    assert rate_text(0.0412, 3100.0) == "0.041 tok/s · 3100.0 s/step"
    assert rate_text(1500.0, 0.2) == "1,500 tok/s"


def _stats(mode: str = "disk") -> SimpleNamespace:
    """The store counters the meter reads (engine/offload/store.py's OffloadStats)."""
    phases = {"forward": 0, "backward": 0}
    return SimpleNamespace(mode=mode, bytes_read=dict(phases), bytes_moved=dict(phases),
                           load_s=0.0, wait_s=0.0)  # fmt: skip


def test_offload_progress_says_bytes_read_rate_and_bound():
    now = [0.0]
    stats = _stats()
    meter = StoreMeter(stats, clock=lambda: now[0])
    stats.bytes_read["forward"] += 6 * 2**30  # read in 4 s of loading, 6 s of them waited
    stats.load_s, stats.wait_s, now[0] = 4.0, 6.0, 8.0
    step = meter.step()
    assert step["read_bytes"] == 6 * 2**30 and step["read_bytes_per_s"] == 6 * 2**30 / 4
    assert (step["wait_share"], step["bound"]) == (0.75, "read")
    now[0] += 10.0  # a step of compute only: nothing read
    assert meter.line() == "read 0 B at 0 B/s · compute-bound (waited 0% of the step)"
    assert meter.totals() == {"offload_bytes_read": 6 * 2**30, "offload_load_s": 4.0,
                              "offload_wait_s": 6.0}  # fmt: skip
    out = io.StringIO()
    bar = RichProgress(MetricsCallback(lambda row: None), Console(file=out, width=200),
                       meter.line)  # fmt: skip
    bar.on_train_begin(ARGS, _state(0, 0), None)
    stats.bytes_read["backward"] += 3 * 2**30
    stats.load_s, stats.wait_s, now[0] = 6.0, 6.5, now[0] + 1.0
    bar.on_step_end(ARGS, _state(1, 10), None)
    bar.close()
    assert "read 3.0 GiB at 1.5 GiB/s · compute-bound (waited 50% of the step)" in out.getvalue()


def test_cpu_offload_progress_says_what_was_copied():
    stats, now = _stats("cpu"), [0.0]
    meter = StoreMeter(stats, clock=lambda: now[0])
    stats.bytes_moved["forward"], stats.load_s, stats.wait_s, now[0] = 2**30, 0.5, 0.9, 1.0
    assert meter.line() == "copied 1.0 GiB at 2.0 GiB/s · read-bound (waited 90% of the step)"


def test_human_bytes():
    assert [human_bytes(n) for n in (512, 2048, 5 * 2**20)] == ["512 B", "2.0 KiB", "5.0 MiB"]


def test_jsonl_log_drops_a_torn_line_and_truncates_to_a_step(tmp_path):
    log = JsonlLog(tmp_path / "m.jsonl")
    for step in (1, 2, 3):
        log.append({"step": step})
    with log.path.open("a") as fh:
        fh.write('{"step": 4, "lo')
    assert [r["step"] for r in log.read()] == [1, 2, 3]
    log.truncate_after(2)
    assert log.path.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_atomic_write_leaves_only_the_target(tmp_path):
    target = tmp_path / "a.json"
    atomic_write_text(target, "one")
    atomic_write_text(target, "two")
    assert target.read_text() == "two"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_atomic_write_never_renames_over_a_device_or_a_folder(tmp_path):
    """As root a rename replaced /dev/full itself with the text (`report --out /dev/full`)."""
    from moetune.errors import MoetuneError

    for target, why in ((Path("/dev/null"), "not a regular file"), (tmp_path, "a directory")):
        with pytest.raises(MoetuneError, match=why):
            atomic_write_text(target, "text")
    assert Path("/dev/null").is_char_device() and list(tmp_path.iterdir()) == []
    (tmp_path / "ro.txt").write_text("old")
    (tmp_path / "ro.txt").chmod(0o444)  # a read-only file is replaced, as a rename does
    atomic_write_text(tmp_path / "ro.txt", "new")
    assert (tmp_path / "ro.txt").read_text() == "new"


def test_replace_dir_swaps_a_complete_directory(tmp_path):
    old, new = tmp_path / "adapter", tmp_path / ".adapter.tmp"
    old.mkdir()
    (old / "w").write_text("old")
    new.mkdir()
    (new / "w").write_text("new")
    replace_dir(new, old)
    assert (old / "w").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_config_diff_names_each_changed_key():
    cfg = parse_config({"train": {"learning_rate": 1e-3}})
    saved = json.dumps(parse_config({"train": {"learning_rate": 2e-3}}).model_dump(mode="json"))
    assert config_diff(saved, cfg) == ["train.learning_rate (0.002 -> 0.001)"]
    assert config_diff(json.dumps(cfg.model_dump(mode="json")), cfg) == []


def test_saved_config_masks_lane_env_secrets_and_resume_still_matches():
    def cfg(token: str, offline: str = "1"):
        env = {"HF_TOKEN": token, "HF_HUB_OFFLINE": offline}
        return parse_config({"lane": {"env": env, "public_env": ["HF_HUB_OFFLINE", "HF_TOKEN"]}})

    saved = dump_config(cfg("hf_" + "a" * 30))
    assert "hf_aaa" not in saved
    assert yaml.safe_load(saved)["lane"]["env"] == {"HF_TOKEN": "***", "HF_HUB_OFFLINE": "1"}
    assert config_diff(saved, cfg("hf_" + "a" * 30)) == []  # --resume accepts its own run
    assert config_diff(saved, cfg("hf_" + "b" * 30)) == []  # a rotated token is no change
    changed = config_diff(saved, cfg("hf_" + "a" * 30, "0"))
    assert changed == ["lane.env.HF_HUB_OFFLINE ('1' -> '0')"]  # public: its value is kept
    hidden = parse_config({"lane": {"env": {"DB_PASS": "opensesame-9"}}})  # not public
    assert yaml.safe_load(dump_config(hidden))["lane"]["env"] == {"DB_PASS": "***"}


def test_config_diff_on_an_unreadable_saved_config():
    with pytest.raises(TrainError, match="not valid YAML"):
        config_diff("not: [valid", parse_config({}))
