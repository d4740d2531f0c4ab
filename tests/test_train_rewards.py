"""GRPO rewards (registry and module:function), the train.method / train.tuning config, and
the preference / prompt data formats with their errors named by file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetune.config import GrpoArgs, RewardArgs, parse_config
from moetune.data import read_checked
from moetune.errors import ConfigError
from moetune.train.errors import DataError
from moetune.train.grpo.rewards import RewardError, build_reward, build_rewards


def _reward(**kw):
    return build_reward(RewardArgs.model_validate(kw))


def shout_reward(prompts, completions, **columns):  # a user's module:function reward
    return [float(c.isupper()) for c in completions]


def nan_reward(prompts, completions, **columns):  # a reward that has gone wrong everywhere
    return [float("nan")] * len(completions)


def some_nan_reward(prompts, completions, **columns):  # NaN, Inf, a string, None, numbers
    bad = [float("nan"), float("inf"), "high", None]
    return [bad[i] if i < len(bad) else 1.0 for i in range(len(completions))]


NOT_A_FUNCTION = 3


def broken_reward(prompts, completions, **columns):  # a user's reward with a bug in it
    return [len(c) / columns["missing"] for c in completions]


def test_exact_match_compares_the_stripped_completion_with_the_answer_column():
    f = _reward(name="exact_match")
    got = f(["p"] * 3, ["aabb", " aabb\n", "ab"], answer=["aabb", "aabb", "aabb"])
    assert got == [1.0, 1.0, 0.0]
    chat = f(["p"], [[{"role": "assistant", "content": "x"}]], answer=["x"])
    assert chat == [1.0]
    other = _reward(name="exact_match", column="gold")
    assert other(["p"], ["7"], gold=[7]) == [1.0]


def test_edit_similarity_credits_a_near_miss_and_only_the_answer_fully():
    f = _reward(name="edit_similarity")
    # the right letter without the stop, a substitution, nothing in common, the answer
    got = f(["p"] * 5, ["fhhg", "17", "x", "", " f\n"], answer=["f", "18", "f", "f", "f"])
    assert got == [0.25, 0.5, 0.0, 0.0, 1.0]
    assert f(["p"], ["kitten"], answer=["sitting"]) == [pytest.approx(1 - 3 / 7)]
    gold = _reward(name="edit_similarity", column="gold")
    assert gold(["p"], [[{"role": "assistant", "content": "ab"}]], gold=["ab"]) == [1.0]


def test_regex_and_length_rewards():
    fmt = _reward(name="regex", pattern=r"<a>\d+</a>")
    assert fmt(["p"] * 2, ["<a>12</a>", "<a>x</a>"]) == [1.0, 0.0]
    length = _reward(name="length", target_chars=4)
    assert length(["p"] * 3, ["abcd", "ab", "abcdefghij"]) == [1.0, 0.5, 0.0]


def test_user_function_by_module_path():
    f = _reward(name="test_train_rewards:shout_reward")
    assert f(["p"] * 2, ["YES", "no"]) == [1.0, 0.0]


def test_an_error_inside_a_user_reward_names_the_reward_and_its_cause():
    f = _reward(name="test_train_rewards:broken_reward")
    assert f.__name__ == "broken_reward"  # TRL logs it under its own name
    with pytest.raises(RewardError) as err:
        f(["p"], ["x"])
    assert err.value.cause == "reward test_train_rewards:broken_reward raised KeyError: 'missing'"
    assert err.value.exit_code == 2 and "one float per completion" in err.value.fix


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ({"name": "exact"}, "unknown reward 'exact'"),
        ({"name": "no_such_module_xyz:f"}, "cannot import no_such_module_xyz"),
        ({"name": "test_train_rewards:missing"}, "has no 'missing'"),
        ({"name": "test_train_rewards:NOT_A_FUNCTION"}, "is a int, not a function"),
        ({"name": "regex"}, "needs a pattern"),
        ({"name": "regex", "pattern": "(("}, "not a valid pattern"),
        ({"name": "length"}, "needs target_chars"),
    ],
)
def test_reward_errors_say_what_is_wrong(entry, says):
    with pytest.raises(RewardError) as err:
        _reward(**entry)
    assert says in err.value.cause and err.value.fix


def test_rewards_come_with_their_weights_and_none_is_refused():
    funcs, weights = build_rewards(
        GrpoArgs.model_validate({"rewards": [{"name": "exact_match"}, {"name": "length",
                                 "target_chars": 3, "weight": 0.5}]})
    )  # fmt: skip
    assert len(funcs) == 2 and weights == [1.0, 0.5]
    with pytest.raises(RewardError, match="empty"):
        build_rewards(GrpoArgs.model_validate({"rewards": []}))


def test_non_finite_reward_values_are_failed_rewards_counted_and_reported():
    (guarded,), _ = build_rewards(
        GrpoArgs.model_validate({"rewards": [{"name": "test_train_rewards:some_nan_reward"}]})
    )
    got = guarded(["p"] * 6, ["a"] * 6)
    assert got == [None, None, None, None, 1.0, 1.0]  # None: TRL's "no reward" (nansum)
    assert (guarded.failed, guarded.scored) == (3, 6)  # the None the function chose: not failed
    assert guarded.warning().startswith("reward test_train_rewards:some_nan_reward: 3 of 6")
    assert guarded.__name__ == "some_nan_reward"  # TRL's metric name is the function's


def test_a_step_without_one_finite_reward_fails_naming_the_reward():
    (guarded,), _ = build_rewards(
        GrpoArgs.model_validate({"rewards": [{"name": "test_train_rewards:nan_reward"}]})
    )
    with pytest.raises(RewardError) as err:
        guarded(["p"] * 4, ["a"] * 4)
    assert "reward test_train_rewards:nan_reward returned no finite value" in err.value.cause
    assert err.value.exit_code == 2 and "finite number" in err.value.fix


def test_old_method_values_name_the_new_field():
    with pytest.raises(ConfigError) as err:
        parse_config({"train": {"method": "qlora"}})
    assert "train.tuning" in err.value.cause and "\n" not in str(err.value)
    cfg = parse_config({"train": {"tuning": "qlora", "method": "grpo"}})
    assert (cfg.train.tuning, cfg.train.method) == ("qlora", "grpo")
    with pytest.raises(ConfigError, match="num_generations"):
        parse_config({"train": {"grpo": {"num_generations": 1}}})


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


PREF = ("preference",)


def test_preference_rows_plain_and_conversational(tmp_path):
    plain = _write(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}] * 2)
    fmt, rows = read_checked(plain, PREF)
    assert fmt.name == "preference" and len(rows) == 2
    turn = [{"role": "user", "content": "q"}]
    chat = [{"prompt": turn, "chosen": [{"role": "assistant", "content": "y"}],
             "rejected": [{"role": "assistant", "content": "n"}]}]  # fmt: skip
    assert read_checked(_write(tmp_path / "c.jsonl", chat), PREF)[0].name == "preference"


@pytest.mark.parametrize(
    ("rows", "says"),
    [
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "b"}],
         "line 2: missing 'rejected'"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"},
          {"prompt": "a", "chosen": "b", "rejected": "b"}], "line 2: 'chosen' and 'rejected'"),
        ([{"prompt": "a", "completion": "b"}], "line 1: prompt/completion rows, not for this"),
    ],
)  # fmt: skip
def test_bad_preference_rows_are_named_by_file_and_line(tmp_path, rows, says):
    path = _write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as err:
        read_checked(path, PREF)
    assert str(path) in err.value.cause and says in err.value.cause


def test_prompt_rows_keep_their_columns_and_must_share_them(tmp_path):
    good = _write(tmp_path / "g.jsonl", [{"prompt": "a", "answer": "1"}] * 3)
    fmt, rows = read_checked(good, ("prompt",))
    assert fmt.name == "prompt" and rows[0][1] == {"answer": "1", "prompt": "a"}
    bad = _write(tmp_path / "b.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    with pytest.raises(DataError, match=r"b\.jsonl line 2: columns differ .*answer"):
        read_checked(bad, ("prompt",))
