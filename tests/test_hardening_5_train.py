"""Issue 48 (fifth hardening pass), training: a GRPO reward of the wrong shape is refused
before the model is built – each reward is called once on the first row's prompt with a
stand-in completion, as TRL calls it – not after the weights load and a rollout ran."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from moetune.config import RewardArgs
from moetune.errors import MoetuneError
from moetune.train import train
from moetune.train.grpo.rewards import GuardedReward, build_reward
from test_train_helpers import reverse_rows, run_config, save_tiny_model, write_jsonl


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


def _rewrite_in_place(path: Path) -> None:
    """Same size, other bytes: the tensor data after the header, inverted, written in place."""
    header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    with path.open("r+b") as f:
        f.seek(header)
        data = f.read(4096)
        f.seek(header)
        f.write(bytes(b ^ 0xFF for b in data))


@pytest.mark.parametrize(
    ("during", "when"),
    [("before", "before the step-1 checkpoint"), ("after", "before the final adapter was saved")],
)
def test_a_base_file_rewritten_during_the_run_stops_it_naming_the_file(
    files, tmp_path, monkeypatch, during, when
):
    import moetune.train.trainer as trainer_module

    _, model, _ = files
    base = tmp_path / "base"
    shutil.copytree(model, base)
    size = (base / "model.safetensors").stat().st_size
    fit = trainer_module.fit

    def rewritten_around_fit(*args, **kwargs):  # the weights are loaded: now the file changes
        if during == "before":
            _rewrite_in_place(base / "model.safetensors")
        fit(*args, **kwargs)
        if during == "after":  # after the last checkpoint, before the adapter is saved
            _rewrite_in_place(base / "model.safetensors")

    monkeypatch.setattr(trainer_module, "fit", rewritten_around_fit)
    rows = write_jsonl(tmp_path / "rows.jsonl", reverse_rows(8))
    cfg = run_config(base, rows, tmp_path / "run", max_steps=1, save_steps=1)
    with pytest.raises(MoetuneError) as info:
        train(cfg, progress=False)  # was: trained on and saved without a word
    assert (base / "model.safetensors").stat().st_size == size
    cause = info.value.cause
    assert "base weight file model.safetensors was rewritten" in cause and when in cause
    assert not (tmp_path / "run" / "adapter").exists()
    saved = sorted(p.name for p in (tmp_path / "run").rglob("*") if "checkpoint-" in p.name
                   or p.parent.name == "checkpoints")  # fmt: skip
    assert saved == (["step-1"] if during == "after" else [])  # written before the change
