"""`lora.stack: mlx` in `moetune train`: mlx-lm trains moetune's recipe on the demo base,
its losses land in metrics.jsonl, the audit reads mlx-lm's trainable parameters, and the
adapter comes back in peft format giving mlx-lm's own logits in transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'moetune[mlx]')")

from moetune.config import parse_config
from moetune.demo.base import MAX_LEN, SHIPPED_DIR
from moetune.ledger import Ledger
from moetune.train import train

TOKENS = [[7, 8, 9, 10, 11, 12, 13, 14]]


def _config(tmp: Path, **train_over: object) -> object:
    from itertools import islice

    from moetune.demo.skills import stream, to_prompt_completion, write_jsonl

    rows = to_prompt_completion(list(islice(stream(["copy"], 0, "train"), 48)))
    data = write_jsonl(tmp / "train.jsonl", rows)
    return parse_config({
        "model": {"id": str(SHIPPED_DIR), "dtype": "float32"},
        "lora": {"stack": "mlx", "rank": 4, "targets": ["attention", "experts"]},
        "data": {"sources": [{"path": str(data)}]},  # the torch stack's data path (mlx_data)
        "output": {"dir": str(tmp / "run"), "ledger": str(tmp / "ledger.jsonl")},
        "train": {"seq_len": MAX_LEN, "batch_size": 4, "max_steps": 12, "learning_rate": 1e-3,
                  "logging_steps": 4, "device": "cpu", "gradient_checkpointing": False,
                  **train_over},
    })  # fmt: skip


@pytest.fixture(scope="module")
def mlx_run(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("mlx-stack")
    cfg = _config(tmp)
    return cfg, train(cfg, progress=False), tmp


def test_metrics_are_mlx_lm_losses(mlx_run) -> None:
    _, result, tmp = mlx_run
    rows = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r for r in rows if "loss" in r]
    assert [r["step"] for r in losses] == [4, 8, 12]  # mlx-lm reports every logging_steps
    assert result.final_loss == losses[-1]["loss"] and result.steps == 12
    assert any("eval_loss" in r for r in rows)  # mlx-lm's validation reports too
    assert losses[-1]["lr"] < 1e-3  # the run's cosine schedule, not mlx-lm's constant 1e-5
    import yaml

    config = yaml.safe_load((tmp / "run" / "mlx" / "lora.yaml").read_text())
    assert config["learning_rate"] == 1e-3 and config["iters"] == 12 and config["batch_size"] == 4
    assert config["data"] == str(tmp / "run" / "mlx" / "data") and config["mask_prompt"] is True


def test_coverage_from_mlx_lm_trainable_parameters(mlx_run) -> None:
    _, result, tmp = mlx_run
    coverage = json.loads((tmp / "run" / "coverage.json").read_text())
    assert coverage["source"] == "mlx-lm trainable_parameters()"
    assert coverage["by_kind"]["experts"] == {"adapted": 9, "expected": 9}  # 3 layers x 3
    assert coverage["by_kind"]["attention"] == {"adapted": 12, "expected": 12}
    assert coverage["router_adapted"] is False and result.coverage == 1.0
    # rank 4 on q/k/v/o (128 -> 128 / 64) and on 8 experts' gate/up/down (128 <-> 128)
    attention = 4 * (128 + 128) * 2 + 4 * (128 + 64) * 2
    experts = 3 * 8 * 4 * (128 + 128)
    assert coverage["trainable_params"] == 3 * (attention + experts)


def test_adapter_is_peft_and_serves_what_mlx_trained(mlx_run) -> None:
    """The converted adapter in transformers gives mlx-lm's logits with its own adapter."""
    from moetune.export.mlx import _relative, mlx_logits, peft_logits

    _, result, tmp = mlx_run
    peft_config = json.loads((Path(result.adapter_dir) / "adapter_config.json").read_text())
    assert peft_config["peft_type"] == "LORA" and "mlp.experts.gate_up_proj" in str(peft_config)
    work = tmp / "run" / "mlx"
    served = mlx_logits(work / "model", work / "adapters", TOKENS)
    trained = peft_logits(SHIPPED_DIR, result.adapter_dir, TOKENS)
    assert _relative(trained, served) < 1e-5
    plain = mlx_logits(work / "model", None, TOKENS)
    assert _relative(plain, served) > 1e-4  # training moved the model


def test_ledger_row_and_summary(mlx_run) -> None:
    cfg, result, tmp = mlx_run
    (row,) = Ledger(cfg.output.ledger).read().rows
    assert row.kind == "train" and row.status == "ok"
    assert row.metrics["adapter_dir"] == result.adapter_dir and row.metrics["device"] == "mlx-cpu"
    summary = json.loads((tmp / "run" / "summary.json").read_text())
    assert summary["stack"] == "mlx" and summary["mlx"]["backend"] in ("cpu", "metal", "cuda")


def test_resume_is_refused(mlx_run, tmp_path: Path) -> None:
    from moetune.train.errors import TrainError

    cfg = _config(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("x: 1\n")
    with pytest.raises(TrainError):
        train(cfg, resume=True, progress=False)


@pytest.mark.parametrize(("over", "named"), [({"method": "dpo"}, "train.method=dpo"),
                                             ({"nproc": 2}, "train.nproc=2")])  # fmt: skip
def test_what_mlx_lm_cannot_train_is_refused_before_a_file_is_written(
    tmp_path: Path, over: dict[str, object], named: str
) -> None:
    from moetune.train.errors import TrainError
    from moetune.train.mlx.stack import train_mlx

    with pytest.raises(TrainError, match=named):
        train_mlx(_config(tmp_path, **over), False, False, (False, False), False)
    assert not (tmp_path / "run").exists()


def test_prompt_completion_rows_tokenize_as_trl_does(mlx_run) -> None:
    """mlx-lm renders string prompt/completion rows through the plain template: prompt,
    completion, one EOS (the demo's completions already end with it), loss offset at the
    prompt's end – the token ids TRL trains on."""
    from mlx_lm.tuner.datasets import CompletionsDataset
    from mlx_lm.utils import load_tokenizer

    _, _, tmp = mlx_run
    tok = load_tokenizer(tmp / "run" / "mlx" / "model")
    row = {"prompt": "copy:abc>", "completion": "abc<eos>"}
    ids, offset = CompletionsDataset([row], tok, "prompt", "completion", True).process(row)
    assert ids == tok.encode("copy:abc>abc<eos>") and offset == len(tok.encode("copy:abc>"))
    bare = {"prompt": "copy:abc>", "completion": "abc"}
    assert CompletionsDataset([bare], tok, "prompt", "completion", True).process(bare)[0] == ids


def test_stacks_pick_their_trainer() -> None:
    from moetune.train import trainer
    from moetune.train.mlx.stack import train_mlx
    from moetune.train.stacks import stack_trainer

    assert stack_trainer("peft") is trainer._train
    assert stack_trainer("mlx") is train_mlx
