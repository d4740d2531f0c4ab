"""Issue 48 (fifth hardening pass), training: a GRPO reward of the wrong shape is refused
before the model is built – each reward is called once on the first row's prompt with a
stand-in completion, as TRL calls it – not after the weights load and a rollout ran."""

from __future__ import annotations

import pytest

from moetune.config import RewardArgs
from moetune.errors import MoetuneError
from moetune.train import train
from moetune.train.grpo.rewards import GuardedReward, build_reward
from test_train_helpers import run_config, save_tiny_model, write_jsonl


def dict_reward(prompts, completions, **columns):
    return {"score": [1.0] * len(completions)}


def none_reward(prompts, completions, **columns):
    return None


def one_short_reward(prompts, completions, **columns):
    return [1.0] * (len(completions) - 1)


def picky_reward(prompts, completions, answer, trainer_state, **columns):
    """Right shape, reads TRL's own keyword arguments, and cannot score an empty completion."""
    if not completions[0]:
        raise ValueError("nothing to score")
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("rewards")
    rows = [{"prompt": f"rev:{w}>", "answer": w[::-1]} for w in ("ab", "cd", "ef", "gh")]
    return root, save_tiny_model(root / "model"), write_jsonl(root / "prompts.jsonl", rows)


def _grpo(files, out, reward):
    _, model, data = files
    grpo = {"num_generations": 4, "max_completion_length": 4,
            "rewards": [{"name": f"test_hardening_5_train:{reward}"}]}  # fmt: skip
    return run_config(model, data, out, method="grpo", max_steps=1, batch_size=4, grpo=grpo)


@pytest.mark.parametrize(
    ("reward", "says"),
    [("dict_reward", "returned a dict"), ("none_reward", "returned None"),
     ("one_short_reward", "returned 3 values for 4 completions")],
)  # fmt: skip
def test_a_reward_of_the_wrong_shape_is_refused_before_the_model_loads(
    files, tmp_path, monkeypatch, reward, says
):
    def never(*_, **__):
        raise AssertionError("the model was built before the reward was checked")

    monkeypatch.setattr("moetune.train.trainer.load_model", never)
    with pytest.raises(MoetuneError) as info:
        train(_grpo(files, tmp_path / "run", reward), progress=False)
    assert f"reward test_hardening_5_train:{reward} {says}" in info.value.cause
    assert "per completion" in info.value.fix and "\n" not in info.value.cause
    assert not (tmp_path / "run").exists()


def test_a_reward_that_cannot_score_the_stand_in_is_left_to_its_first_call():
    from moetune.train.grpo.rewards import dry_call

    name = "test_hardening_5_train:picky_reward"
    reward = GuardedReward(name, build_reward(RewardArgs(name=name)))
    dry_call([reward], {"prompt": "rev:ab>", "answer": "ba"}, 4)  # raises inside: not judged
    got = reward(["rev:ab>"] * 2, ["ba", "x"], answer=["ba", "ba"], trainer_state=None)
    assert got == [1.0, 0.0]
