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
