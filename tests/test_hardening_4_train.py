"""Issue 48 (fourth hardening pass), training settings and GRPO: the documented default
writable as documented, a reward of the wrong shape named as such (one line, exit 2)."""

from __future__ import annotations

import pytest

from moetune.config import parse_config
from moetune.config.load import load_yaml
from moetune.errors import ConfigError
from moetune.train.grpo.rewards import GuardedReward, RewardError


def _grpo(text: str, overrides: list[str] | None = None):
    data = load_yaml("model: {id: Qwen/Qwen3-30B-A3B}\ntrain:\n  method: grpo\n" + text)
    return parse_config(data, overrides).train.grpo


def test_routing_replay_off_unquoted_is_the_documented_default():
    assert _grpo("  grpo: {routing_replay: off}\n").routing_replay == "off"  # YAML: false
    assert _grpo("", ["train.grpo.routing_replay=off"]).routing_replay == "off"
    assert _grpo("  grpo: {routing_replay: replay}\n").routing_replay == "replay"
    with pytest.raises(ConfigError, match="routing_replay"):  # true names no mode
        _grpo("  grpo: {routing_replay: on}\n")


@pytest.mark.parametrize(
    ("returned", "cause"),
    [
        ({"a": 1.0, "b": 0.0}, "returned a dict, not a list of values"),
        (None, "returned None, not a list of values"),
        ("1.0", "returned a str, not a list of values"),
        ([1.0], "returned 1 values for 2 completions"),
        ([1.0, 0.0, 0.5], "returned 3 values for 2 completions"),
    ],
)
def test_a_reward_of_the_wrong_shape_is_named(returned, cause):
    reward = GuardedReward("mine:score", lambda prompts, completions, **kw: returned)
    with pytest.raises(RewardError) as info:
        reward(["p1", "p2"], ["c1", "c2"])
    assert f"reward mine:score {cause}" in info.value.cause and "per completion" in info.value.fix


def test_a_reward_of_the_right_shape_passes_none_and_numpy_included():
    import numpy as np

    reward = GuardedReward("mine:score", lambda prompts, completions, **kw: np.array([1.0, 2]))
    assert reward(["p1", "p2"], ["c1", "c2"]) == [1.0, 2.0]
    assert GuardedReward("r", lambda *a, **k: [None, 0.5])(["p"] * 2, ["c"] * 2) == [None, 0.5]


def test_a_stored_base_with_nproc_2_is_refused_in_the_launcher(tmp_path):
    """Before: each rank refused it after ~40 lines of launcher trace, with a --resume fix."""
    from typer.testing import CliRunner

    from moetune.cli import app
    from moetune.config import dump_config
    from moetune.engine.stored.write import write_stored
    from test_train_helpers import reverse_rows, run_config, save_tiny_model, write_jsonl

    fp8 = write_stored(save_tiny_model(tmp_path / "float"), tmp_path / "fp8", "fp8", block=(8, 8))
    data = write_jsonl(tmp_path / "d.jsonl", reverse_rows(8))
    cfg = run_config(fp8, data, tmp_path / "run", lora__targets=["attention", "experts"])
    (tmp_path / "run.yaml").write_text(dump_config(cfg))
    got = CliRunner().invoke(app, ["train", str(tmp_path / "run.yaml"), "--nproc", "2"])
    assert got.exit_code == 2, got.output
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and "kept as stored (fp8) trains on several processes" in lines[0]
    assert "--strategy ep" in lines[0]  # what runs it there (engine/ep_load.py)
    assert "--resume" not in lines[0] and "Traceback" not in got.output
    assert not (tmp_path / "run").exists()  # no rank started, nothing written


def test_the_same_tracker_twice_is_refused_not_logged_twice():
    data = load_yaml("model: {id: Qwen/Qwen3-30B-A3B}\noutput: {report_to: [tensorboard]}\n")
    assert parse_config(data).output.report_to == ["tensorboard"]
    with pytest.raises(ConfigError) as info:  # was: two tensorboard event files for one run
        parse_config(data, ["output.report_to=[tensorboard, tensorboard]"])
    assert "report_to" in info.value.cause and "tensorboard twice" in info.value.cause


def test_a_failed_launch_offers_resume_only_past_a_checkpoint():
    """Ranks that died before any checkpoint were told to rerun with --resume (it cannot help)."""
    from moetune.config.sections import TrainArgs
    from moetune.train.launch import _failed

    t = TrainArgs(nproc=2)
    assert "--resume" not in _failed(t, 1, resumable=False).fix
    assert "--resume" in _failed(t, 1, resumable=True).fix
