"""The Python API (docs/api.md): `import moetune` stays light, `moetune.load` gives the peft
model `moetune train` trains (coverage audited, router frozen, split engine), and a plain
TRL SFTTrainer over it trains the adapter `moetune train` trains, to 1e-6 in fp32."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import moetune
from moetune.config import RunConfig
from moetune.errors import ConfigError
from test_train_helpers import one_thread, reverse_rows, run_config, save_tiny_model, write_jsonl


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    model = save_tiny_model(root / "model")
    data = write_jsonl(root / "train.jsonl", reverse_rows(12))
    return root, model, data


def test_import_moetune_loads_no_torch() -> None:
    """A notebook's `import moetune` costs nothing: torch, transformers load on first use."""
    code = (
        "import sys, moetune; heavy = {'torch', 'transformers', 'peft', 'trl'} & set(sys.modules);"
        "assert not heavy, heavy; assert 'load' in dir(moetune)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_public_names_are_the_api() -> None:
    """Each public name forwards to moetune.api (loaded on first use), none is a stage's
    package (`moetune.train` stays the package once it loads)."""
    import moetune.api

    assert set(moetune.__all__) <= set(dir(moetune))
    exported = {n for n, v in vars(moetune.api).items() if not n.startswith("_")}
    assert set(moetune.__all__) - {"RunConfig"} == exported - {
        "configure",
        "hooks",
        "loading",
        "stages",
    }  # its modules
    for name in moetune.__all__:
        assert getattr(moetune, name) is not None, name
    with pytest.raises(AttributeError):
        _ = moetune.no_such_name


def test_callbacks_refuse_a_model_moetune_did_not_load() -> None:
    """Without the spec moetune.load keeps, the routers are unknown: one line, no guess."""
    with pytest.raises(ConfigError, match=r"did not come from moetune\.load"):
        moetune.callbacks(torch.nn.Linear(2, 2))


def test_config_from_a_dict_a_yaml_or_keywords_is_one_config(tiny, tmp_path) -> None:
    _, model, data = tiny
    doc = {"model": {"id": str(model)}, "lora": {"rank": 8}, "data": {"train_file": str(data)}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    from_kw = moetune.run_config(model=str(model), lora={"rank": 8}, data={"train_file": str(data)})
    assert moetune.run_config(doc) == from_kw == moetune.run_config(path)
    over = moetune.run_config(path, lora={"rank": 2}, train={"seed": 7})
    assert (over.lora.rank, over.train.seed, over.model.id) == (2, 7, str(model))
    with pytest.raises(ConfigError, match=r"lora\.rank"):
        moetune.run_config(doc, lora={"rank": "many"})
    with pytest.raises(ConfigError, match="not a section"):
        moetune.run_config(doc, lora=8)
    with pytest.raises(ConfigError, match="no configuration"):
        moetune.run_config()


def _adapter(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors"))


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(
        float((a[k].double() - b[k].double()).norm() / a[k].double().norm().clamp_min(1e-30))
        for k in a
    )


def _user_sft(cfg: RunConfig, out: Path) -> tuple[Path, Any]:
    """The user's own script: moetune.load, then a plain TRL SFTTrainer with the run's
    hyperparameters over the rows as `datasets` reads them; the adapter dir and the load."""
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    loaded = moetune.load(cfg)
    model, tokenizer = loaded
    t = cfg.train
    args = SFTConfig(
        output_dir=str(out), max_steps=t.max_steps, learning_rate=t.learning_rate,
        per_device_train_batch_size=t.batch_size, max_length=t.seq_len, seed=t.seed,
        lr_scheduler_type="cosine", warmup_steps=t.warmup_ratio, use_cpu=True,
        bf16=loaded.precision == "bf16",  # TRL's default is bf16, moetune's on a CPU fp32
        router_aux_loss_coef=0.0, report_to=[], save_strategy="no", logging_steps=1,
    )  # fmt: skip
    dataset = load_dataset("json", data_files=cfg.data.train_file, split="train")
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
        callbacks=moetune.callbacks(model, out / "logs", routing_every=2),
    )  # fmt: skip
    trainer.train()
    trainer.save_model(str(out / "adapter"))
    return out / "adapter", loaded


def _same_adapter(cfg: RunConfig, out: Path) -> Any:
    """`moetune train` and the user's script on `cfg`: their adapters equal to 1e-6."""
    with one_thread():
        ours = moetune.train_run(cfg, progress=False)
        theirs, loaded = _user_sft(cfg, out)
    trained = _adapter(Path(ours.adapter_dir))
    assert _max_rel(trained, _adapter(theirs)) <= 1e-6
    assert any(".experts." in k for k in trained)  # the experts' LoRA is among them
    assert all(trained[k].abs().max() > 0 for k in trained if "lora_B" in k)  # B starts at 0
    return loaded


def _user_trl_matches(
    cfg: RunConfig,
    rows: Path,
    out: Path,
    config_cls: Any,
    trainer_cls: Any,
    method: dict[str, Any],
    **trainer_kwargs: Any,
) -> None:
    """`moetune train` on `cfg`, then a plain TRL trainer over moetune.load's model with the
    run's own settings (`method`: the method's fields): their adapters equal to 1e-6."""
    from datasets import load_dataset

    with one_thread():
        ours = moetune.train_run(cfg, progress=False)
        loaded = moetune.load(cfg)
        model, tokenizer = loaded
        t = cfg.train
        args = config_cls(
            output_dir=str(out), max_steps=t.max_steps, learning_rate=t.learning_rate,
            per_device_train_batch_size=t.batch_size, seed=t.seed, lr_scheduler_type="cosine",
            use_cpu=True, bf16=loaded.precision == "bf16", router_aux_loss_coef=0.0,
            report_to=[], save_strategy="no", **method,
        )  # fmt: skip
        dataset = load_dataset("json", data_files=str(rows), split="train")
        trainer = trainer_cls(model=model, args=args, train_dataset=dataset,
                              processing_class=tokenizer, **trainer_kwargs)  # fmt: skip
        trainer.train()
        trainer.save_model(str(out / "adapter"))
    assert _max_rel(_adapter(Path(ours.adapter_dir)), _adapter(out / "adapter")) <= 1e-6


def test_user_sft_trainer_trains_what_moetune_train_trains(tiny) -> None:
    """moetune.load + a plain TRL SFTTrainer (the user's own script) gives the adapter
    `moetune train` gives for the same config and data: same seed, same row order."""
    root, model_dir, data = tiny
    cfg = run_config(model_dir, data, root / "run", max_steps=4, save_steps=4, routing_every=0)
    loaded = _same_adapter(cfg, root / "user")
    assert loaded.coverage.coverage == 1.0 and not loaded.coverage.router_adapted
    assert loaded.engine == "moetune"  # split LoRA on the experts
    logs = root / "user" / "logs"
    assert len((logs / "metrics.jsonl").read_text().splitlines()) == 4  # one a logged step
    assert len((logs / "routing.jsonl").read_text().splitlines()) == 2  # steps 2 and 4


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, sections",
    [
        ("nf4", {"model": {"experts_dtype": "nf4"}}),
        ("int8", {"model": {"experts_dtype": "int8"}}),
        ("offload", {"train": {"offload": "cpu"}}),
    ],
)
def test_user_sft_trainer_matches_on_every_way_to_load(tiny, name, sections) -> None:
    """NF4 / int8 experts and experts offloaded to host RAM: the user's trainer over the
    model moetune.load gives still trains `moetune train`'s adapter."""
    root, model_dir, data = tiny
    base = run_config(model_dir, data, root / name, max_steps=3, save_steps=3, routing_every=0)
    cfg = moetune.run_config(base, **sections)
    loaded = _same_adapter(cfg, root / f"user-{name}")
    assert loaded.engine == "moetune"


def test_recipe_emits_the_load_the_plan_fits_and_it_runs(tiny) -> None:
    """`moetune recipe` on a run with NF4 experts emits `moetune.load` with those choices
    (not only a plain peft config, which would not load it so); executed, that code loads
    the base with NF4 expert stacks and audited split LoRA."""
    from typer.testing import CliRunner

    from moetune.cli import app
    from moetune.engine.quant.stacks import QuantizedStack

    _, model_dir, _ = tiny
    sets = ["model.experts_dtype=nf4", "lora.rank=4", "train.device=cpu", "train.seq_len=64"]
    args = ["recipe", str(model_dir), *[a for s in sets for a in ("--set", s)], "--json"]
    got = CliRunner().invoke(app, args)
    assert got.exit_code == 0, got.output
    load = json.loads(got.stdout)["load"]
    assert load["engine"] == "moetune"
    assert any("nf4" in why for why in load["needs_moetune"])
    code = load["code"]
    assert "'experts_dtype': 'nf4'" in code and "'engine': 'moetune'" in code
    scope: dict[str, object] = {}
    with one_thread():
        exec(compile(code, "recipe", "exec"), scope)  # the user's paste, as it is printed
    model = scope["model"]
    stacks = [m for m in model.modules() if isinstance(m, QuantizedStack)]  # type: ignore[attr-defined]
    assert stacks and {s.backend.name for s in stacks} == {"nf4"}
    assert model.peft_config["default"].r == 4  # type: ignore[attr-defined]


def test_recipe_of_a_plain_run_says_peft_alone_does_it(tiny) -> None:
    from moetune.model import load_spec
    from moetune.recipe import recipe_for

    _, model_dir, _ = tiny
    cfg = moetune.run_config(model=str(model_dir), lora={"engine": "peft"})
    load = recipe_for(load_spec(cfg.model.id), cfg.lora, cfg)["load"]
    assert load == {"code": load["code"], "engine": "peft", "needs_moetune": []}
    assert "lora={'engine': 'peft'}" in load["code"]


@pytest.mark.slow
def test_user_dpo_trainer_trains_what_moetune_train_trains(tiny) -> None:
    """A plain TRL DPOTrainer over moetune.load's model (split expert LoRA: TRL adds its
    frozen "ref" copy of the fresh adapter beside it) trains the adapter `moetune train`
    trains, whose reference is the adapter disabled – the same policy while LoRA B is zero."""
    from trl import DPOConfig, DPOTrainer

    from test_train_methods import preference_rows

    root, model_dir, _ = tiny
    pref = write_jsonl(root / "pref.jsonl", preference_rows(8))
    cfg = run_config(model_dir, pref, root / "dpo", method="dpo", max_steps=3, save_steps=3,
                     routing_every=0)  # fmt: skip
    d = cfg.train.dpo
    method = dict(max_length=cfg.train.seq_len, beta=d.beta, loss_type=[d.loss_type])
    _user_trl_matches(cfg, pref, root / "user-dpo", DPOConfig, DPOTrainer, method)


@pytest.mark.slow
def test_user_sft_trainer_matches_over_a_stored_fp8_base(tiny) -> None:
    """A base published FP8 (block scales), read as stored by moetune.load: the user's
    trainer still trains `moetune train`'s adapter."""
    from moetune.engine.stored.write import write_stored

    root, model_dir, data = tiny
    fp8 = write_stored(model_dir, root / "fp8-base", "fp8", block=(8, 8))
    cfg = run_config(fp8, data, root / "fp8", max_steps=3, save_steps=3, routing_every=0)
    loaded = _same_adapter(cfg, root / "user-fp8")
    assert loaded.stored is not None and loaded.engine == "moetune"


@pytest.mark.slow
def test_user_grpo_trainer_trains_what_moetune_train_trains(tiny) -> None:
    """A plain TRL GRPOTrainer over moetune.load's model, with the user's own exact-match
    reward, samples and trains as `moetune train --set train.method=grpo` does."""
    from trl import GRPOConfig, GRPOTrainer

    from test_train_methods import GRPO, prompt_rows

    def exact(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [float(c.strip() == a.strip()) for c, a in zip(completions, answer, strict=True)]

    root, model_dir, _ = tiny
    rows = write_jsonl(root / "prompts.jsonl", prompt_rows(8))
    cfg = run_config(model_dir, rows, root / "grpo", method="grpo", max_steps=2, save_steps=2,
                     routing_every=0, batch_size=4, grpo=GRPO)  # fmt: skip
    g = cfg.train.grpo
    _user_trl_matches(cfg, rows, root / "user-grpo", GRPOConfig, GRPOTrainer,
                      dict(num_generations=g.num_generations, beta=g.beta, loss_type=g.loss_type,
                           max_completion_length=g.max_completion_length),
                      reward_funcs=[exact])  # fmt: skip
