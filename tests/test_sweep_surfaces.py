"""Issue 48's fresh sweep, the CLI surfaces this round added: `push`, expert-parallel
launches, the install / doctor checks and the card's memory – each hostile-but-fair command
is refused with exit 2 and one line naming its cause and a fix, before anything is built
or started (no rank is ever launched here: the launcher's spawn raises). Cases marked
"was:" failed on the previous main. Stored-format metadata: tests/test_sweep_stored.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from click.testing import CliRunner
from huggingface_hub import constants

import moetune.train.launch as launch_mod
from fake_hub import FakeHub
from moetune.cli import app
from moetune.config import SourceArgs
from moetune.data.sources import stream_source
from moetune.demo.base import SHIPPED_DIR
from moetune.errors import MoetuneError
from moetune.lint.torch_index import Machine, choose

# typer builds the click command anew on every invoke (~0.2 s); the sweep builds it once
CLI = typer.main.get_command(app)

BASE = str(SHIPPED_DIR)  # qwen3_moe, 8 routed experts
TOKEN = "hf_sweepSURFACEtokenX4c7V9b2N5m8"
DENSE = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 512}  # fmt: skip
ROW = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """run.yamls on the demo base and on a dense base, a half-made run dir (config.yaml and
    an adapter_config only: never evaluated), a run dir with a broken config."""
    root = tmp_path_factory.mktemp("sweep-surfaces")
    data = root / "rows.jsonl"
    data.write_text(json.dumps(ROW) + "\n")
    (root / "dense").mkdir()
    (root / "dense" / "config.json").write_text(json.dumps(DENSE))
    texts = {
        "run.yaml": f"model: {{id: {BASE}}}\noutput: {{dir: {root}/out}}\n",
        "train.yaml": f"model: {{id: {BASE}}}\ndata: {{sources: [{{path: {data}}}]}}\n"
        f"output: {{dir: {root}/out-train}}\n",
        "dense.yaml": f"model: {{id: {root}/dense}}\ndata: {{sources: [{{path: {data}}}]}}\n"
        f"output: {{dir: {root}/out-dense}}\n",
        "nan.yaml": f"model: {{id: {BASE}}}\nhardware: {{card_memory_gb: .nan}}\n",
        "card.yaml": f"model: {{id: {BASE}}}\nhardware: {{card: garbage}}\n",
        "badrun/config.yaml": "model: {id: /nonexistent}\nbogus: 1\n",
        "run/config.yaml": f"model: {{id: {BASE}}}\n",
        "run/adapter/adapter_config.json": '{"peft_type": "LORA"}',
    }
    for name, text in texts.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.fixture
def no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    def spawned(*args: Any, **kwargs: Any) -> int:
        raise AssertionError("a rank was launched for input that must be refused first")

    monkeypatch.setattr(launch_mod, "_run_ranks", spawned)


PUSH = ["push", "{d}/run", "--repo"]
CASES: list[tuple[str, list[str], str]] = [
    # push: the repo id, the run, what goes on the card
    ("push/repo-no-slash", [*PUSH, "noslash"], "--repo noslash is not a Hub repo id"),
    ("push/repo-empty", [*PUSH, ""], "is not a Hub repo id"),
    ("push/repo-three-parts", [*PUSH, "a/b/c"], "--repo a/b/c is not"),
    ("push/repo-space", [*PUSH, "user/my model"], "is not a Hub repo id"),
    ("push/repo-url", [*PUSH, "https://huggingface.co/u/n"], "is not a Hub repo id"),
    ("push/repo-token", [*PUSH, f"{TOKEN}@user/name"], "is not a Hub repo id"),
    ("push/repo-token-colon", [*PUSH, f"user:{TOKEN}/name"], "is not a Hub repo id"),
    ("push/repo-dotdot", [*PUSH, "../name"], "--repo ../name is not"),
    ("push/repo-newline", [*PUSH, "u/n\nx"], "is not a Hub repo id"),
    ("push/repo-97-chars", [*PUSH, "u/" + "n" * 97], "at most 96 characters"),  # was: sent
    ("push/repo-double-dash", [*PUSH, "u/a--b"], "no '--' or '..'"),  # was: sent
    ("push/repo-dot-git", [*PUSH, "u/name.git"], "is not a Hub repo id"),  # was: sent
    ("push/run-missing", ["push", "{d}/nope", "--repo", "u/n"], "not a moetune run directory"),
    ("push/run-is-a-file", ["push", "{d}/rows.jsonl", "--repo", "u/n"], "no config.yaml"),
    ("push/not-a-run", ["push", "{d}/dense", "--repo", "u/n"], "no config.yaml"),
    ("push/never-evaluated", [*PUSH, "u/n"], "is not promoted (it was never gated)"),
    ("push/broken-config", ["push", "{d}/badrun", "--repo", "u/n"], "holds no trained adapter"),
    ("push/export-missing", [*PUSH, "u/n", "--export", "gguf"], "has no gguf export on disk"),
    ("push/export-path", [*PUSH, "u/n", "--export", "../../etc"], "has no ../../etc export"),
    ("push/license-prose", [*PUSH, "u/n", "--unpromoted", "--license", "not a license!"],
     "is not a Hub license id"),  # was: a repo created, then the Hub's refusal
    ("push/license-yaml", [*PUSH, "u/n", "--unpromoted", "--license", "mit\nfoo: bar"],
     "is not a Hub license id"),  # was: a YAML key planted in the card
    ("push/license-upper", [*PUSH, "u/n", "--unpromoted", "--license", "MIT"],
     "--license MIT is not a Hub license id"),
    ("push/base-prose", [*PUSH, "u/n", "--unpromoted", "--base-model", "not a model"],
     "--base-model not a model is not a Hub repo id"),  # was: sent
    ("push/results-missing", [*PUSH, "u/n", "--results", "{d}/nope"],
     "is not a directory"),  # was: ignored, "never gated"
    ("push/results-file", [*PUSH, "u/n", "--results", "{d}/rows.jsonl"], "is not a directory"),
    # ep launches that stay refused, and --nproc / --nnodes nonsense
    ("ep/dense", ["train", "{d}/dense.yaml", "--nproc", "2", "--strategy", "ep"],
     "places routed experts, and"),
    ("ep/not-dividing", ["train", "{d}/train.yaml", "--nproc", "3", "--strategy", "ep"],
     "8 routed experts do not split evenly over 3 ranks"),
    ("ep/more-than-experts", ["train", "{d}/train.yaml", "--nproc", "16", "--strategy", "ep"],
     "16 expert-parallel ranks for 8 routed experts"),
    ("ep/absurd", ["train", "{d}/train.yaml", "--nproc", "100000", "--strategy", "ep"],
     "100000 expert-parallel ranks"),
    ("ep/peft", ["train", "{d}/train.yaml", "--nproc", "2", "--strategy", "ep", "--set",
                 "lora.engine=peft"], "resolves lora.engine to peft"),
    ("ep/nnodes-0", ["train", "{d}/train.yaml", "--nproc", "2", "--strategy", "ep",
                     "--nnodes", "0"], "train.nnodes must be a positive integer"),
    ("ep/strategy-typo", ["train", "{d}/train.yaml", "--nproc", "2", "--strategy", "expert"],
     "train.strategy must be one of"),
    ("nproc/0", ["train", "{d}/train.yaml", "--nproc", "0"], "--nproc 0: train.nproc must be"),
    ("nproc/-1", ["train", "{d}/train.yaml", "--nproc", "-1"], "--nproc -1: train.nproc"),
    ("nproc/absurd", ["train", "{d}/train.yaml", "--nproc", "100000"], "CPU ranks on this node"),
    ("nproc/past-64-bits", ["train", "{d}/train.yaml", "--nproc", str(10**30)], "below 2**63"),
    ("nproc/true", ["train", "{d}/train.yaml", "--set", "train.nproc=true"],
     "not true / false"),  # was: one process, as if 1 had been asked
    # doctor, --card and hardware.card_memory_gb
    ("doctor/bad-run-yaml", ["doctor", "{d}/badrun/config.yaml"], "unknown key 'bogus'"),
    ("doctor/missing", ["doctor", "{d}/none.yaml"], "none.yaml: not found"),
    ("doctor/run-dir", ["doctor", "{d}/badrun"], "neither a run.yaml nor a model"),  # was: exit 0
    ("doctor/memory-nan", ["doctor", "{d}/nan.yaml"], "hardware.card_memory_gb: must be"),
    ("doctor/card-garbage", ["doctor", "{d}/card.yaml"], "unknown card 'garbage'"),
    ("doctor/probe-alone", ["doctor", "--probe-mib", "4"], "only apply with --calibrate"),
    ("card/garbage", ["plan", "{d}/run.yaml", "--card", "garbage"], "unknown card 'garbage'"),
    ("card/near-lower", ["plan", "{d}/run.yaml", "--card", "h100"], "did you mean"),
    ("card/near-prefix", ["plan", "{d}/run.yaml", "--card", "H100"], "H100-80GB"),
    ("card/empty", ["plan", "{d}/run.yaml", "--card", ""], "unknown card ''"),
    ("card/0GB", ["plan", "{d}/run.yaml", "--card", "0GB"],
     "card memory of 0 GB, outside 1 to 10,000 GB"),  # was: "did you mean A10G"
    ("card/100000GB", ["plan", "{d}/run.yaml", "--card", "100000GB"], "outside 1 to 10,000"),
    ("card/negative", ["plan", "{d}/run.yaml", "--card", "-5GB"], "unknown card '-5GB'"),
    ("card/nanGB", ["plan", "{d}/run.yaml", "--card", "nanGB"], "unknown card 'nanGB'"),
    ("memory/0", ["plan", "{d}/run.yaml", "--set", "hardware.card_memory_gb=0"],
     "hardware.card_memory_gb: must be a card's memory in GB (1 to 10,000)"),
    ("memory/negative", ["plan", "{d}/run.yaml", "--set", "hardware.card_memory_gb=-1"],
     "hardware.card_memory_gb: must be"),
    ("memory/nan", ["plan", "{d}/run.yaml", "--set", "hardware.card_memory_gb=nan"], "(got nan)"),
    ("memory/inf", ["plan", "{d}/run.yaml", "--set", "hardware.card_memory_gb=inf"], "(got inf)"),
    ("memory/1e9", ["plan", "{d}/run.yaml", "--set", "hardware.card_memory_gb=1e9"],
     "card_memory_gb: must be a card's memory"),  # was: "unknown card '1e+09GB'"
    ("memory/1e-9", ["plan", "{d}/run.yaml", "--set", "hardware.card_memory_gb=1e-9"],
     "card_memory_gb: must be a card's memory"),  # was: "unknown card '1e-09GB'"
    ("memory/word", ["plan", "{d}/run.yaml", "--set", "hardware.card_memory_gb=lots"], "lots"),
    ("memory/true", ["plan", "{d}/run.yaml", "--set", "hardware.card_memory_gb=true"],
     "must be a number, not true / false"),  # was: planned a 1 GB card
    ("memory/and-card", ["plan", "{d}/run.yaml", "--set", "hardware.card=H100-80GB", "--set",
                         "hardware.card_memory_gb=24"], "both name the card"),
    # the other sizes in GB are held like the card's (was: host_ram_gb=1e300 planned a fit)
    ("host-ram/1e300", ["plan", "{d}/run.yaml", "--host-ram", "1e300"],
     "hardware.host_ram_gb must be a node's RAM in GB (1 to 100,000)"),
    ("host-ram/inf", ["plan", "{d}/run.yaml", "--set", "hardware.host_ram_gb=inf"], "(got inf)"),
    ("host-ram/nan", ["plan", "{d}/run.yaml", "--set", "hardware.host_ram_gb=nan"], "(got nan)"),
    ("host-ram/0", ["plan", "{d}/run.yaml", "--set", "hardware.host_ram_gb=0"], "node's RAM"),
    ("host-ram/negative", ["plan", "{d}/run.yaml", "--set", "hardware.host_ram_gb=-64"],
     "node's RAM"),
    ("host-ram/true", ["plan", "{d}/run.yaml", "--set", "hardware.host_ram_gb=true"],
     "not true / false"),
    ("disk/1e300", ["plan", "{d}/run.yaml", "--set", "hardware.disk_gb=1e300"],
     "hardware.disk_gb: must be a disk's size in GB (1 to 1,000,000)"),
    ("disk/volume-absurd", ["plan", "{d}/run.yaml", "--set", "lane.volume_gb=1000000000"],
     "lane.volume_gb: must be a disk's size"),
    ("disk/container-absurd", ["plan", "{d}/run.yaml", "--set",
                               "lane.runpod.container_disk_gb=1000000000"], "disk's size"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "args", "says"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_on_a_new_surface_is_one_line_exit_2(
    scratch: Path, no_ranks: None, name: str, args: list[str], says: str
) -> None:
    argv = [a.replace("{d}", str(scratch)) for a in args]
    result = CliRunner().invoke(CLI, argv)
    assert result.exit_code == 2, (result.exit_code, result.output)
    line = result.stderr.strip().splitlines()[-1]  # a library may warn above it on import
    assert line.startswith("error: ") and says in line and " fix: " in line, line
    assert TOKEN not in result.output


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    server = FakeHub(TOKEN).start()
    yield server
    server.stop()


@pytest.mark.parametrize("token", ["", "hf_notTheWriteToken000000000000000"])
def test_push_without_a_usable_token_is_one_line_and_uploads_nothing(
    scratch: Path, hub: FakeHub, monkeypatch: pytest.MonkeyPatch, token: str
) -> None:
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(scratch / "no-token"))
    monkeypatch.setenv("HF_TOKEN", token)
    ledger = scratch / f"ledger-{len(token)}.jsonl"
    result = CliRunner().invoke(CLI, ["push", str(scratch / "run"), "--repo", "u/n",
                                      "--unpromoted", "--ledger", str(ledger)])  # fmt: skip
    assert result.exit_code == 2, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert "the Hub refused the push to u/n" in line and "HF_TOKEN" in line
    assert hub.repos == {} and not any(r["authorised"] for r in hub.requests)
    assert token not in result.output + ledger.read_text() or not token
    assert json.loads(ledger.read_text().splitlines()[-1])["status"] == "failed"


MACHINE = Machine("Linux", "x86_64", (12, 8))


@pytest.mark.parametrize(
    "value", ["cu999", "CPU", "rocm", "rocm6", "cu12.8", "pypi2", " cpu", "--index-url=evil"]
)
def test_moetune_torch_of_an_unknown_build_names_the_choices(value: str) -> None:
    """`make setup` runs lint/torch_index.py before moetune is installed: a bad
    MOETUNE_TORCH ends it with one line naming the builds (SystemExit's message)."""
    with pytest.raises(SystemExit) as info:
        choose(MACHINE, value)
    text = str(info.value.code)
    assert f"MOETUNE_TORCH={value!r}" in text and "use cpu, pypi, rocmX.Y or one of cu130" in text
    assert "\n" not in text


@pytest.mark.parametrize(("value", "build"), [("rocm6.4", "rocm6.4"), ("cu126", "cu126"),
                                              ("pypi", "pypi"), ("", "cu128")])  # fmt: skip
def test_moetune_torch_of_a_real_build_is_taken(value: str, build: str) -> None:
    assert choose(MACHINE, value).build == build  # "" is unset: the driver's own choice


def test_the_surfaces_sweep_has_its_cases() -> None:
    names = [c[0] for c in CASES]
    assert len(names) == len(set(names)) >= 55


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "holds no rows datasets can read"),  # was: exit 3, "unexpected StopIteration"
        ("hello\n", "cannot be read"),
        ('{"prompt": "a", "completion": "b"}\n{"prompt": "a", "compl', "cannot be read"),
    ],
)
def test_a_streamed_source_that_is_not_json_rows_is_one_data_error(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], text: str, says: str
) -> None:
    """What lint's tokenizer rule and data.streaming read: a DataError naming the source,
    and not datasets' own ERROR line on stderr (it repeats the cause with no fix, and after
    lint's report it was the one line a user saw – the developers' sweep, data/lint/*)."""
    (tmp_path / "train.jsonl").write_text(text)
    with pytest.raises(MoetuneError) as info:
        list(stream_source(SourceArgs(path=str(tmp_path / "train.jsonl"))))
    assert says in info.value.cause and "train.jsonl" in info.value.cause
    assert "Failed to load JSON" not in capfd.readouterr().err
