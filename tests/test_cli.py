"""The CLI end to end: JSON shapes users script against, and bad input as one line + exit != 0."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from moetune.cli import app
from moetune.errors import ConfigError
from moetune.model.tiny import TINY_CONFIGS

runner = CliRunner()


def _run(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def _model_dir(tmp_path: Path, variant: str) -> str:
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIGS[variant]))
    return str(tmp_path)


def test_inspect_json_has_the_documented_keys() -> None:
    code, out, _ = _run("inspect", "Qwen/Qwen3-30B-A3B", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["total_params"] == 30_532_122_624
    assert data["active_params"] == 3_353_032_704
    assert data["num_experts"] == 128 and data["top_k"] == 8 and data["num_layers"] == 48
    assert data["moe_layers"] == list(range(48))
    assert sum(data["components"].values()) == data["total_params"]


def test_inspect_dense_model_says_not_moe(tmp_path: Path) -> None:
    code, out, _ = _run("inspect", _model_dir(tmp_path, "qwen2"))
    assert code == 0 and "not an MoE" in out


def _assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code != 0
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) <= 2, err  # one message (rich may wrap a long line once)
    assert "Traceback" not in err
    text = " ".join(lines)
    for needle in needles:
        assert needle in text, text


def test_missing_config_json(tmp_path: Path) -> None:
    code, _, err = _run("inspect", str(tmp_path))
    _assert_one_line_error(code, err, "config.json")


def test_invalid_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    code, _, err = _run("inspect", str(tmp_path))
    _assert_one_line_error(code, err, "config.json")


def test_unknown_family(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "frobnicator"}))
    code, _, err = _run("inspect", str(tmp_path))
    _assert_one_line_error(code, err, "frobnicator", "upgrade transformers")


def test_hub_id_while_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = _run("inspect", "some-org/not-in-the-catalog-MoE")
    _assert_one_line_error(code, err, "some-org/not-in-the-catalog-MoE")


def test_dense_model_with_expert_targets(tmp_path: Path) -> None:
    code, _, err = _run("recipe", _model_dir(tmp_path, "qwen2"), "--targets", "attention,experts")
    _assert_one_line_error(code, err, "experts")


@pytest.mark.parametrize("flag", [["--rank", "0"], ["--rank", "-8"], ["--seq", "0"]])
def test_non_positive_rank_or_seq(flag: list[str]) -> None:
    code, _, err = _run("plan", "Qwen/Qwen3-30B-A3B", *flag)
    _assert_one_line_error(code, err, "positive")


@pytest.mark.parametrize(("rank", "said"), [(10**30, "below 2**63"), (70000, "at most 65536")])
def test_a_rank_no_model_could_hold_is_one_line_not_an_overflow(
    tmp_path: Path, rank: int, said: str
) -> None:
    run = tmp_path / "run.yaml"  # 10**30 was an "unexpected TypeError" (exit 3) in torch
    run.write_text(f"model: {{id: Qwen/Qwen3-30B-A3B}}\nlora: {{rank: {rank}}}\n")
    code, _, err = _run("recipe", str(run))
    _assert_one_line_error(code, err, f"lora.rank: must be {said}")
    assert "fix: set lora.rank to" in err


def test_no_lora_targets_is_refused_by_plan_too(tmp_path: Path) -> None:
    code, _, err = _run("plan", "Qwen/Qwen3-30B-A3B", "--targets", ",")  # was planned, exit 0
    _assert_one_line_error(code, err, "--targets", "must be a comma list of attention")
    run = tmp_path / "run.yaml"
    run.write_text("model: {id: Qwen/Qwen3-30B-A3B}\nlora: {targets: []}\n")
    code, _, err = _run("plan", str(run))
    _assert_one_line_error(code, err, "lora.targets: must name at least one part to train")
    assert code == 2


def test_unknown_key_in_run_yaml(tmp_path: Path) -> None:
    run = tmp_path / "run.yaml"
    run.write_text("model:\n  id: Qwen/Qwen3-30B-A3B\ntrain:\n  seqlen: 4096\n")
    code, _, err = _run("lint", str(run))
    _assert_one_line_error(code, err, "train.seqlen")


def test_unknown_card_id_lists_the_known_ones() -> None:
    code, _, err = _run("plan", "Qwen/Qwen3-30B-A3B", "--card", "TPU-v9")
    _assert_one_line_error(code, err, "TPU-v9", "H100-80GB")


def test_plan_json_acceptance_case() -> None:
    code, out, _ = _run(
        "plan", "Qwen/Qwen3-30B-A3B", "--mapping", "automap", "--targets", "attention,experts",
        "--engine", "peft", "--seq", "2048", "--batch", "1", "--card", "H100-80GB",
        "--card", "H200", "--card", "H100-NVL", "--json",
    )  # fmt: skip
    assert code == 0
    plan = json.loads(out)
    assert plan["fits"] == {"H100-80GB": False, "H200": True, "H100-NVL": True}
    assert plan["trainable_params"] == 994_836_480
    assert plan["estimator"] == "analytic" and plan["overhead_bytes"] > 0
    assert sum(plan["components"].values()) == plan["peak_bytes"]
    assert any(r["card"] == "H100-80GB" for r in plan["recommendations"])


def test_plan_json_best_per_card_reproduces_its_peak(tmp_path: Path) -> None:
    from moetune.config import load_config
    from moetune.model import load_spec
    from moetune.plan import card_ids
    from moetune.plan.fit import analytic
    from moetune.plan.offload.memory import plan_offload

    run = tmp_path / "run.yaml"
    run.write_text(
        "model:\n  id: Qwen/Qwen3-30B-A3B\nlora:\n  rank: 16\n  targets: [attention, experts]\n"
        "  engine: peft\n  expert_mapping: automap\ntrain:\n  seq_len: 2048\n  batch_size: 1\n"
    )
    code, out, _ = _run("plan", str(run), "--json")
    assert code == 0
    best = json.loads(out)["best"]
    assert list(best) == card_ids()
    spec = load_spec("Qwen/Qwen3-30B-A3B")
    for card, rec in best.items():
        assert rec["card"] == card and rec["fits"], rec["text"]
        # the overrides, given to the same run.yaml as --set, give the predicted peak (an
        # offloaded one: the device's live tensors as the offload plan has them)
        cfg = load_config(run, rec["overrides"])
        if cfg.train.offload != "none":
            off = plan_offload(spec, cfg, card)
            assert off.device_peak_bytes - off.device_components["overhead"] == rec["peak_bytes"]
            continue
        assert analytic(spec, cfg).peak_bytes == rec["peak_bytes"]
        assert rec["headroom_bytes"] >= 0
    four = best["RTX-4090"]
    assert "model.experts_dtype=nf4" in four["overrides"] and four["peak_bytes"] <= 22 * 1024**3
    assert best["H100-80GB"]["overrides"] == ["lora.engine=moetune"]  # the switch alone fits
    assert best["H200"]["overrides"] == [] and best["H200"]["cost"] == 0.0


def test_plan_prints_the_best_config_per_card() -> None:
    code, out, _ = _run(
        "plan", "Qwen/Qwen3-30B-A3B", "--targets", "attention,experts", "--card", "RTX-4090",
        "--card", "H200",
    )  # fmt: skip
    assert code == 0
    assert "best config per card" in out
    assert "RTX-4090: --set lora.engine=moetune --set model.experts_dtype=nf4" in out


def test_plan_of_an_uncalibrated_mixer_kind_says_it_traced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses

    from moetune.model.census import shrunk_config
    from moetune.plan.profiles.registry import NEMOTRON_H, PROFILES

    # nemotron_h as it planned before its Mamba2 term: a kind with no calibrated term
    uncalibrated = dataclasses.replace(NEMOTRON_H, mixers={**NEMOTRON_H.mixers, "mamba": None})
    monkeypatch.setitem(PROFILES, "nemotron_h", uncalibrated)

    (tmp_path / "config.json").write_text(json.dumps(shrunk_config("nemotron_h")))
    args = ("plan", str(tmp_path), "--seq", "64", "--card", "H200")
    code, out, _ = _run(*args)
    assert code == 0
    assert "peak memory by component (trace)" in out
    assert "note: analytic has no calibrated activation term for nemotron_h's mamba" in out
    code, out, _ = _run(*args, "--json")
    plan = json.loads(out)
    assert plan["estimator"] == "trace" and plan["estimator_requested"] == "analytic"
    assert "mamba" in plan["notes"][0]


# -- shortcut options: each one a config field, so a flag and its field cannot drift -----


def _commands() -> dict[str, Any]:
    import typer

    group: Any = typer.main.get_command(app)
    lane: Any = group.commands["pods"]
    return {**group.commands, "pods list": lane.commands["list"]}


SHORTCUT_COMMANDS = ["plan", "recipe", "train", "quickstart", "eval", "launch", "pods list"]


def _shortcut_params() -> list[tuple[str, Any]]:
    from moetune.cli.options import SHORTCUTS

    commands = _commands()
    return [
        (name, param)
        for name in SHORTCUT_COMMANDS
        for param in commands[name].params
        if param.name in SHORTCUTS
    ]


def test_every_shortcut_is_a_field_moetune_schema_documents() -> None:
    from moetune.cli.options import SHORTCUTS

    code, out, _ = _run("schema", "--json")
    fields = {row["field"] for row in json.loads(out)}
    assert code == 0 and {cut.field for cut in SHORTCUTS.values()} <= fields
    used = {param.name for _, param in _shortcut_params()}
    assert used == set(SHORTCUTS)  # no shortcut declared that no command takes


def test_each_option_takes_its_fields_type_and_its_help_lists_the_values() -> None:
    from typing import Annotated, get_args, get_origin

    from moetune.cli.options import SHORTCUTS, _base, accepts, choices, field_info

    for command, param in _shortcut_params():
        cut = SHORTCUTS[param.name]
        assert param.opts == [cut.flag], (command, param.opts)
        assert f"{cut.field}: " in param.help, (command, param.help)
        values = choices(cut.field)
        kind = param.type_descriptor.annotation  # what typer parses the flag's text into
        if values:  # a choice field: the flag takes text, the help names every value
            assert kind is str and all(v in param.help for v in values), (command, param.help)
        elif cut.negate:
            assert kind is bool and field_info(cut.field).annotation is bool
            assert f"{cut.field}: false" in param.help
        elif cut.switch:  # an on-switch: the flag alone sets its bool field true
            assert kind is bool and field_info(cut.field).annotation is bool
            assert f"{cut.field}: true" in param.help
        elif cut.comma:  # a list of free text (--hosts): one comma list, as text
            assert kind is str and get_origin(_base(field_info(cut.field).annotation)) is list
        else:  # numbers and text: the type the field holds, its rule in the help
            held = _base(field_info(cut.field).annotation)
            held = get_args(held)[0] if get_origin(held) is Annotated else held
            assert kind is held, (command, cut.flag, kind, held)
            assert f"{cut.field}: {accepts(cut.field)})" in param.help, (command, param.help)


def test_a_flag_accepts_exactly_its_fields_values() -> None:
    from moetune.cli.options import SHORTCUTS, choices, option_overrides
    from moetune.config import parse_config

    for name, cut in SHORTCUTS.items():
        values = choices(cut.field)
        if not values or cut.comma:
            continue
        for value in values:  # every value the field takes reaches the field
            cfg = parse_config({}, option_overrides(**{name: value}))
            section, leaf = cut.field.split(".")
            assert getattr(getattr(cfg, section), leaf) == value
        with pytest.raises(ConfigError) as err:
            option_overrides(**{name: "bogus"})
        assert err.value.cause.startswith(f"{cut.flag} bogus: {cut.field} must be one of ")
        assert all(v in err.value.fix for v in values)
    cfg = parse_config({}, option_overrides(targets="attention, router", no_gc=True, rank=4))
    assert cfg.lora.targets == ["attention", "router"] and cfg.lora.rank == 4
    assert cfg.train.gradient_checkpointing is False
    assert option_overrides(no_gc=False, rank=None) == []  # not given: YAML and defaults win


def test_provider_help_lists_every_registered_provider() -> None:
    from moetune.lane.providers import provider_names

    for command in ("launch", "pods list", "eval"):
        param = next(p for p in _commands()[command].params if p.name == "provider")
        assert all(name in param.help for name in provider_names()), (command, param.help)
    assert "skypilot" in provider_names()
    code, out, _ = _run("launch", "--help")  # as a user reads it (rich markup rendered)
    assert code == 0 and "local | ssh | runpod | skypilot" in " ".join(out.split())


def test_plan_help_shows_what_each_shortcut_accepts() -> None:
    code, out, _ = _run("plan", "--help")
    text = " ".join(out.replace("│", " ").split())
    assert code == 0
    for shown in (
        "train.tuning: lora | full | qlora",
        "lora.rank: a positive integer (> 0)",
        "like train.strategy: ddp | fsdp | zero3",
        "model.experts_dtype: bf16 | int8",
    ):
        assert shown in text, text


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["plan", "Qwen/Qwen3-30B-A3B", "--tuning", "lorax"], ["--tuning lorax", "qlora"]),
        (["plan", "Qwen/Qwen3-30B-A3B", "--strategy", "zero9"], ["--strategy zero9", "fsdp"]),
        (["plan", "Qwen/Qwen3-30B-A3B", "--gpus", "0"], ["--gpus 0", "positive"]),
        (["recipe", "Qwen/Qwen3-30B-A3B", "--stack", "jax"], ["--stack jax", "peft | mlx"]),
        (["quickstart", "--stack", "jax"], ["--stack jax", "peft | mlx"]),
        (["eval", "run.yaml", "--provider", "nimbus"], ["--provider nimbus", "skypilot"]),
        (["eval", "run.yaml", "--provider", "ssh"], ["eval runs here", "moetune launch"]),
        (["launch", "run.yaml", "--provider", "nimbus"], ["--provider nimbus", "runpod"]),
    ],
)
def test_a_bad_shortcut_value_is_one_line_naming_the_flag(
    args: list[str], needles: list[str]
) -> None:
    code, _, err = _run(*args)
    assert code == 2
    _assert_one_line_error(code, err, *needles)
