"""Nothing non-finite is accepted: a NaN or Inf in an adapter's tensors is refused wherever
an adapter is loaded (export, eval, promote, resume) with exit 2 naming the tensor and the
file and nothing written; a NaN check statistic fails the served == trained check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from export_fixtures import make_run
from moetune.cli import app
from moetune.config import load_config
from moetune.evaluate.gate import promote, verdict_hash
from moetune.evaluate.ladder import run_eval
from moetune.evaluate.results import adapter_digest
from moetune.export.check import CheckResult, Reference, Served, compare, verdict_reason
from moetune.model.finite import NonFiniteError, require_finite_adapter
from moetune.train.rundir.checkpoint import RunDir
from moetune.train.rundir.recovery import resume_point_of

pytestmark = pytest.mark.filterwarnings("ignore")


def poison(adapter_dir: Path, value: float = float("nan")) -> str:
    """Put `value` into one element of one LoRA B tensor; returns that tensor's name."""
    path = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(str(path))
    name = sorted(k for k in tensors if "lora_B" in k)[-1]
    tensors[name].view(-1)[3] = value
    save_file(tensors, str(path), metadata={"format": "pt"})
    return name


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    run = make_run(tmp_path_factory.mktemp("nonfinite"), "qwen3_moe-dense0")
    return run, poison(run / "adapter")


def test_export_of_a_nan_adapter_exits_2_naming_the_tensor_and_writes_nothing(
    nan_run: tuple[Path, str], tmp_path: Path
) -> None:
    run, tensor = nan_run
    out = tmp_path / "merged"
    got = CliRunner().invoke(app, ["export", str(run), "--format", "merged", "--out", str(out)])
    assert got.exit_code == 2, got.output
    text = " ".join(got.output.split())
    assert tensor in text and "adapter_model.safetensors" in text and "1 NaN/Inf" in text
    assert "Traceback" not in got.output and not out.exists()


def test_eval_and_promote_refuse_a_nan_adapter_before_writing(nan_run: tuple[Path, str]) -> None:
    run, tensor = nan_run
    cfg = load_config(run / "config.yaml")
    with pytest.raises(NonFiniteError, match="holds 1 NaN/Inf") as err:
        run_eval(cfg, progress=False)
    assert tensor in err.value.cause and err.value.exit_code == 2
    assert not (run / "eval").exists()  # no results for a gate to read
    results = run / "faked-results"  # a GO verdict for these very bytes, honestly hashed
    verdict = {"verdict": "GO", "reason": "", "adapter": str(run / "adapter"),
               "adapter_sha256": adapter_digest(run / "adapter")}  # fmt: skip
    results.mkdir()
    (results / "verdict.json").write_text(json.dumps({**verdict, "hash": verdict_hash(verdict)}))
    with pytest.raises(NonFiniteError, match=tensor.replace(".", r"\.")):
        promote(results, adapter=run / "adapter")  # the fake holds no ladder.json to locate it
    assert not (run / "adapter" / "PROMOTED").exists()


def test_resume_refuses_a_checkpoint_whose_adapter_holds_inf(
    nan_run: tuple[Path, str], tmp_path: Path
) -> None:
    run, _ = nan_run
    ckpt = tmp_path / "checkpoints" / "step-4"
    ckpt.mkdir(parents=True)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        (ckpt / name).write_bytes((run / "adapter" / name).read_bytes())
    (ckpt / "trainer_state.json").write_text("{}")
    with pytest.raises(NonFiniteError) as err:
        resume_point_of(RunDir(tmp_path))
    assert err.value.cause.startswith("--resume: checkpoint step 4:")
    assert "move" in err.value.fix and str(ckpt) in err.value.fix


def test_a_finite_adapter_passes_and_inf_is_caught_like_nan(tmp_path: Path) -> None:
    path = tmp_path / "adapter_model.safetensors"
    save_file({"a": torch.ones(4), "steps": torch.arange(3)}, str(path))
    require_finite_adapter(tmp_path)  # finite floats and integer tensors: nothing to say
    save_file({"a": torch.tensor([1.0, float("-inf"), 2.0])}, str(path))
    with pytest.raises(NonFiniteError, match="tensor a holds 1 NaN/Inf"):
        require_finite_adapter(tmp_path)


def test_a_nan_statistic_fails_the_check_instead_of_passing_it() -> None:
    logits = [torch.randn(5, 8, dtype=torch.float64) for _ in range(3)]
    without = [x + 1.0 for x in logits]  # the expert LoRA moves logits: a real effect
    ref = Reference([[1]] * 3, [[1]] * 3, Served(logits, [[1]] * 3), without)
    broken = [x.clone() for x in logits]
    broken[1][2, 3] = float("nan")  # one consumer logit NaN: "logits rel nan"
    result = compare("merged", "transformers", ref, Served(broken, [[1]] * 3), "float32", 0.5)
    assert result.passed is False and "not finite numbers" in result.reason
    assert "logits_rel_max nan" in result.reason
    same = compare("merged", "transformers", ref, Served(logits, [[1]] * 3), "float32", 0.5)
    assert same.passed is True  # the guard fails only what is not a number
    fields = dict(format="f", consumer="c", passed=True, items=1, logits_rel=0.0,
                  expert_effect=float("inf"), effect_share=0.0, greedy_match=1.0,
                  tolerance=1e-4, min_greedy=0.5)  # fmt: skip
    assert "expert_effect inf" in verdict_reason(CheckResult(**fields))


def test_a_nan_loss_stops_training_with_exit_2_and_a_failed_row(tmp_path: Path) -> None:
    """A base with one Inf weight: every loss is NaN. The trainer's own filter would log
    a running average (0.0 at step 1) and train on; moetune stops at the first log."""
    from moetune.train import TrainError, train
    from test_train_helpers import run_config, save_tiny_model, write_jsonl

    base = save_tiny_model(tmp_path / "base")
    weights = load_file(str(base / "model.safetensors"))
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    weights[head][:, 0] = float("inf")
    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    rows = [{"prompt": "copy:abc>", "completion": "abc"}] * 8
    cfg = run_config(base, write_jsonl(tmp_path / "d.jsonl", rows), tmp_path / "run",
                     max_steps=3, logging_steps=1)  # fmt: skip
    with pytest.raises(TrainError) as err:
        train(cfg, progress=False)
    n_inf = weights[head].shape[0]  # one column of Inf: named as the base's, not a divergence
    said = f"loss is nan at step 1: the base's weight {head} holds {n_inf} NaN/Inf value(s)"
    assert err.value.cause.startswith(said), err.value.cause
    assert not (tmp_path / "run" / "adapter").exists()
    (row,) = [json.loads(x) for x in Path(cfg.output.ledger).read_text().splitlines()]
    assert (row["kind"], row["status"]) == ("train", "failed") and "loss is nan" in row["reason"]
