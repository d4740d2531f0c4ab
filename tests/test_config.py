from pathlib import Path

import pytest

from moetune.config import load_config, parse_config
from moetune.errors import ConfigError


def test_defaults_and_override() -> None:
    cfg = parse_config({"lora": {"rank": 8}}, ["train.seq_len=4096", "lora.targets=[experts]"])
    assert cfg.lora.rank == 8
    assert cfg.lora.effective_alpha == 16.0
    assert cfg.train.seq_len == 4096
    assert cfg.lora.targets == ["experts"]


def test_unknown_key_is_named(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("lora:\n  rnak: 8\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert "lora.rnak" in exc.value.cause and "unknown key" in exc.value.cause


def test_an_old_field_name_is_refused_naming_the_new_one(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("lora:\n  rank: 16\n  experts_rank: 4\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert exc.value.cause.endswith("lora.experts_rank was renamed lora.expert_rank")
    assert exc.value.fix == "write lora.expert_rank: 4 instead"
    with pytest.raises(ConfigError, match=r"renamed lora\.expert_rank"):
        parse_config({}, ["lora.experts_rank=4"])
    lora = parse_config({"lora": {"rank": 16, "expert_rank": 4}}).lora
    assert (lora.effective_expert_rank, lora.effective_expert_alpha) == (4, 8.0)
    assert parse_config({"lora": {"rank": 16}}).lora.effective_expert_rank == 16


@pytest.mark.parametrize("bad", ["lora.rank=0", "lora.rank=-4", "train.seq_len=0"])
def test_non_positive_rejected(bad: str) -> None:
    with pytest.raises(ConfigError, match="positive"):
        parse_config({}, [bad])


@pytest.mark.parametrize(
    ("override", "cause"),
    [
        ("train.learning_rate=.nan", "train.learning_rate: must be a finite number > 0 (got nan)"),
        ("train.learning_rate=-1e-4", "train.learning_rate: must be a finite number > 0"),
        ("train.learning_rate=0", "train.learning_rate: must be a finite number > 0 (got 0)"),
        ("train.max_steps=0", "train.max_steps: must be a positive integer (> 0) (got 0)"),
        ("train.warmup_ratio=1.5", "train.warmup_ratio: must be a fraction in [0, 1) (got 1.5)"),
        ("train.warmup_ratio=-0.1", "train.warmup_ratio: must be a fraction in [0, 1)"),
        ("train.batch_size=-2", "train.batch_size: must be a positive integer (> 0) (got -2)"),
        ("train.grad_accum=0", "train.grad_accum: must be a positive integer"),
        ("train.epochs=.inf", "train.epochs: must be a finite number > 0 (got inf)"),
        ("train.weight_decay=-1", "train.weight_decay: must be a finite number >= 0"),
        ("train.routing_every=-1", "train.routing_every: must be an integer >= 0"),
        ("train.seed=-3", "train.seed: must be an integer >= 0"),
        ("lora.alpha=0", "lora.alpha: must be a finite number > 0"),
        ("lora.dropout=.nan", "lora.dropout: must be a probability in [0, 1) (got nan)"),
        ("lora.expert_selection_share=.nan", "lora.expert_selection_share: must be a share"),
        ("eval.batch_size=0", "eval.batch_size: must be a positive integer"),
        ("lane.max_usd=-5", "lane.max_usd: must be a finite number > 0"),
        ("lane.idle_gpu_percent=150", "lane.idle_gpu_percent: must be a percentage in [0, 100]"),
        ("lane.ssh.port=0", "lane.ssh.port: must be a TCP port"),
        ("lora.rank=" + "9" * 30, "lora.rank: must be below 2**63 (a 64-bit integer)"),
        ("lora.rank=70000", "lora.rank: must be at most 65536 (got 70000)"),
        ("train.max_steps=" + "9" * 20, "train.max_steps: must be below 2**63"),
        ("train.seed=" + "9" * 20, "train.seed: must be below 2**63"),
    ],
)
def test_impossible_numbers_are_refused_naming_field_and_fix(override: str, cause: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config({}, [override])
    assert exc.value.cause.startswith(cause)
    field = override.partition("=")[0]
    assert exc.value.fix.startswith(f"set {field} to ")


def test_nan_margin_of_a_rung_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("eval:\n  rungs:\n    - {name: a, kind: loss, margin: .nan}\n")
    with pytest.raises(ConfigError, match=r"eval\.rungs\.0\.margin: must be a finite number >= 0"):
        load_config(path)


def test_boundary_values_are_accepted() -> None:
    cfg = parse_config(
        {"train": {"warmup_ratio": 0.0, "max_steps": 1, "routing_every": 0, "weight_decay": 0}}
    )
    assert cfg.train.max_steps == 1 and cfg.train.warmup_ratio == 0.0


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("model:\n  id: a\ntrain:\n  steps: 2\nmodel:\n  id: b\n", "key 'model' at line 5"),
        ("lora:\n  rank: 8\n  alpha: 4\n  rank: 16\n", "duplicate key 'rank' at line 4 (first at"),
    ],
)
def test_duplicate_yaml_keys_are_refused_naming_line_and_key(
    tmp_path: Path, text: str, said: str
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert said in exc.value.cause and exc.value.fix == "keep one of the two"
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_config({}, ["lora.targets={a: 1, a: 2}"])


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)  # 9**9 values once expanded: it hung `moetune lint` until killed


@pytest.mark.parametrize(
    ("text", "said", "fix"),
    [
        (
            BOMB + "model: *i\n",
            "its aliases expand to more than 1,000,000 values",
            "write the values",
        ),
        ("model: " + "[" * 3000 + "]" * 3000, "nested too deeply to parse", "flatten"),
    ],
)
def test_alias_bombs_and_deep_nesting_are_refused_not_hung_or_crashed(
    tmp_path: Path, text: str, said: str, fix: str
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert exc.value.cause == f"{path} is not valid YAML: {said}"
    assert exc.value.fix.startswith(fix)


def test_a_few_aliases_still_load() -> None:
    from moetune.config import load_yaml

    assert load_yaml("a: &x [1, 2]\nb: *x\n") == {"a": [1, 2], "b": [1, 2]}


def test_yaml_merge_keys_may_restate_a_key() -> None:
    from moetune.config import load_yaml

    assert load_yaml("a: &x {b: 1}\nc:\n  <<: *x\n  b: 2\n") == {"a": {"b": 1}, "c": {"b": 2}}


def test_an_empty_run_yaml_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match="is empty"):
        load_config(path)


@pytest.mark.parametrize("command", ["train", "eval", "plan"])
def test_an_empty_run_yaml_writes_no_ledger_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    from typer.testing import CliRunner

    from moetune.cli import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text("")
    got = CliRunner().invoke(app, [command, "run.yaml"])
    assert got.exit_code == 2 and "run.yaml is empty" in got.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]  # no .moetune/ ledger


def _list_fields() -> list[str]:
    from moetune.config import schema_rows
    from moetune.config.fields import lists_values

    return [path for path, _, _ in schema_rows() if "[]" not in path and lists_values(path)]


def _two_items(path: str) -> list[str]:
    """Two values the list field accepts: its Literal's first two, else two names."""
    from moetune.cli.options import choices

    return (choices(path) or ["FIRST_NAME", "SECOND_NAME"])[:2]


def test_set_reads_a_comma_list_for_every_list_field() -> None:
    """`--set lora.targets=a,b` was refused where `--targets a,b` worked: every list field
    now takes a comma list and a YAML flow list alike, from the field's own type."""
    fields = _list_fields()
    assert {"lora.targets", "output.report_to", "lane.ssh.hosts", "lane.setup"} <= set(fields)
    for path in fields:
        a, b = _two_items(path)
        section, leaf = path.rsplit(".", 1)
        comma = parse_config({}, [f"{path}={a}, {b}"])
        flow = parse_config({}, [f"{path}=[{a},{b}]"])
        got = [getattr(_section(cfg, section), leaf) for cfg in (comma, flow)]
        assert got == [[a, b], [a, b]], path
    one = parse_config({}, ["lora.targets=experts"])
    assert one.lora.targets == ["experts"]


def _section(cfg: object, dotted: str) -> object:
    for name in dotted.split("."):
        cfg = getattr(cfg, name)
    return cfg


def test_set_keeps_a_quoted_value_one_item_and_maps_untouched() -> None:
    cfg = parse_config({}, ['lane.setup="pip install a,b"', "lane.env.TAGS=a,b"])
    assert cfg.lane.setup == ["pip install a,b"]  # a command may hold commas
    assert cfg.lane.env["TAGS"] == "a,b"  # a mapping's value: text, never split
    with pytest.raises(ConfigError, match=r"lora\.targets"):
        parse_config({}, ["lora.targets=attention,expertz"])


def test_a_flag_and_set_read_a_list_alike() -> None:
    from moetune.cli.options import option_overrides

    flag = parse_config({}, option_overrides(targets="attention, experts"))
    assert flag.lora.targets == parse_config({}, ["lora.targets=attention, experts"]).lora.targets
