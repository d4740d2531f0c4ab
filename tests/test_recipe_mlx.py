"""mlx-lm recipes: keys match mlx-lm's module names per family (docs/knowledge.md §5), every
lora_parameters field is present, and the router never gets a key."""

from __future__ import annotations

import json

import pytest
import yaml

from moetune.config import LoraArgs
from moetune.errors import RecipeError
from moetune.model import ModelSpec, spec_from_config
from moetune.model.tiny import tiny_config
from moetune.recipe import recipe_for
from moetune.recipe.mlx import make_mlx_recipe

ATTENTION = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
GLU = ("gate_proj", "up_proj", "down_proj")


def _under(prefix: str) -> list[str]:
    return [f"{prefix}.{n}" for n in GLU]


# docs/knowledge.md §5: where mlx-lm keeps each family's expert stack (and shared expert)
EXPERT_KEYS = {
    "qwen3_moe-dense0": _under("mlp.switch_mlp"),
    "olmoe": _under("mlp.switch_mlp"),
    "qwen2_moe-shared-dense0": _under("mlp.switch_mlp") + _under("mlp.shared_expert"),
    "mixtral": _under("block_sparse_moe.switch_mlp"),
    "deepseek_v3": _under("mlp.switch_mlp") + _under("mlp.shared_experts"),
    "gpt_oss": _under("mlp.experts"),
}
ROUTERS = {"mlp.gate", "mlp.router", "block_sparse_moe.gate", "mlp.shared_expert_gate"}


def _spec(variant: str) -> ModelSpec:
    return spec_from_config(tiny_config(variant), variant)


@pytest.mark.parametrize("variant", sorted(EXPERT_KEYS))
def test_keys_reach_experts_and_never_the_router(variant: str) -> None:
    out = make_mlx_recipe(_spec(variant), LoraArgs(rank=8, targets=["experts", "shared"]))
    keys = out["config"]["lora_parameters"]["keys"]
    assert keys == EXPERT_KEYS[variant]
    assert not ROUTERS & set(keys)


def test_full_config_for_qwen3_moe() -> None:
    out = make_mlx_recipe(_spec("qwen3_moe-dense0"), LoraArgs(rank=8, alpha=32))
    params = out["config"]["lora_parameters"]
    assert params == {
        "rank": 8,
        "scale": 4.0,  # alpha / rank
        "dropout": 0.0,
        "keys": ATTENTION + _under("mlp.switch_mlp") + _under("mlp"),  # layer 0 is dense
    }
    assert out["config"]["num_layers"] == -1 and out["config"]["fine_tune_type"] == "lora"
    assert out["not_present"] == {"shared": "qwen3_moe-dense0 has no shared experts"}
    assert yaml.safe_load(out["yaml"]) == out["config"]


def test_deepseek_attention_follows_q_lora_rank() -> None:
    keys = make_mlx_recipe(_spec("deepseek_v3"), LoraArgs(targets=["attention"]))["config"]
    names = keys["lora_parameters"]["keys"]
    assert "self_attn.q_a_proj" in names and "self_attn.q_proj" not in names
    direct = make_mlx_recipe(_spec("deepseek_v3-direct-q"), LoraArgs(targets=["attention"]))
    assert "self_attn.q_proj" in direct["config"]["lora_parameters"]["keys"]


@pytest.mark.parametrize(
    ("variant", "lora", "match"),
    [
        ("qwen3_moe-dense0", LoraArgs(targets=["attention", "router"]), "never adapts the router"),
        ("qwen3_moe-dense0", LoraArgs(train_router=True), "never adapts the router"),
        ("llama-biases", LoraArgs(targets=["attention", "experts"]), "is dense"),
        ("dbrx", LoraArgs(), "no mlx-lm recipe for the dbrx family"),
        ("jamba", LoraArgs(), "no mlx-lm recipe for the jamba family"),
    ],
)
def test_refusals(variant: str, lora: LoraArgs, match: str) -> None:
    with pytest.raises(RecipeError, match=match):
        make_mlx_recipe(_spec(variant), lora)


def test_recipe_for_dispatches_on_stack() -> None:
    out = recipe_for(_spec("olmoe"), LoraArgs(stack="mlx", targets=["attention", "experts"]))
    assert out["stack"] == "mlx"
    assert out["config"]["lora_parameters"]["keys"] == ATTENTION + _under("mlp.switch_mlp")


@pytest.mark.parametrize("columns", ["40", "200"])
def test_recipe_stdout_is_yaml_with_the_run_hyperparameters(columns: str) -> None:
    """`moetune recipe --stack mlx` prints YAML mlx_lm.lora can read at any terminal width,
    notes as comments, with the run's learning rate (mlx-lm's own 1e-5 learns nothing)."""
    from typer.testing import CliRunner

    from moetune.cli import app
    from moetune.demo.base import SHIPPED_DIR

    sets = ["train.max_steps=200", "train.learning_rate=1e-3", "train.warmup_ratio=0.05"]
    args = ["recipe", str(SHIPPED_DIR), "--stack", "mlx", "--rank", "8"]
    args += [a for s in sets for a in ("--set", s)]
    result = CliRunner().invoke(app, args, env={"COLUMNS": columns})
    assert result.exit_code == 0, result.output
    config = yaml.safe_load(result.stdout)
    assert config["learning_rate"] == 1e-3 and config["iters"] == 200
    assert config["lora_parameters"]["rank"] == 8 and config["batch_size"] == 1
    assert config["lr_schedule"] == {
        "name": "cosine_decay",
        "arguments": [1e-3, 190, 0.0],
        "warmup": 10,
        "warmup_init": 0.0,
    }
    notes = [line for line in result.stdout.splitlines() if line.startswith("# note:")]
    assert any("shared: not present" in n for n in notes)
    json_out = CliRunner().invoke(app, [*args, "--json"], env={"COLUMNS": columns})
    assert yaml.safe_load(result.stdout) == json.loads(json_out.stdout)["config"]


def test_iters_from_epochs_and_the_schedules() -> None:
    from moetune.config import DataArgs, TrainArgs
    from moetune.recipe.mlx import mlx_train_fields

    train = TrainArgs(epochs=2, batch_size=4, grad_accum=2, lr_scheduler="linear")
    fields, notes = mlx_train_fields(train, DataArgs(completion_only_loss=False), rows=100)
    assert fields["iters"] == 25 and not notes and fields["mask_prompt"] is False
    assert fields["lr_schedule"]["name"] == "linear_schedule"
    assert fields["lr_schedule"]["arguments"] == [2e-4, 0.0, 25]
    _, unknown = mlx_train_fields(TrainArgs(), DataArgs())
    assert unknown == ["iters: mlx-lm's default (1000); set train.max_steps to choose"]
