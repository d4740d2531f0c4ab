"""LoRA recipes that really reach the experts: peft (audited on a meta build) and mlx-lm.

    from moetune.recipe.targets import build_peft_config, make_recipe
    from moetune.recipe.audit import audit_coverage
    from moetune.recipe.mlx import make_mlx_recipe

This package module stays import-light (the rules import it; targets and mlx load torch
and peft only when a recipe is built). Each stack's recipe is registered in STACKS.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rich.syntax import Syntax
from rich.table import Table

from moetune.config.keys import lora_stack
from moetune.recipe.mlx import make_mlx_recipe
from moetune.recipe.targets import make_recipe
from moetune.registry import Registry

if TYPE_CHECKING:
    from rich.console import Console

    from moetune.config import LoraArgs, RunConfig
    from moetune.model.spec import ModelSpec


StackRecipe = Callable[["ModelSpec", "LoraArgs", "RunConfig | None"], dict[str, Any]]
STACKS: Registry[StackRecipe] = Registry("LoRA stack")


@STACKS.register("peft")
def _peft(spec: ModelSpec, lora: LoraArgs, run: RunConfig | None) -> dict[str, Any]:
    """The audited peft config; with the run, the code that loads it as planned (`load`)."""
    # lazy: heavy to import (moetune.engine loads torch; this package stays light)
    from moetune.recipe.loading import load_plan

    recipe = make_recipe(spec, lora).to_json()
    return recipe | ({"load": load_plan(spec, run)} if run is not None else {})


@STACKS.register("mlx")
def _mlx(spec: ModelSpec, lora: LoraArgs, run: RunConfig | None) -> dict[str, Any]:
    if run is None:
        return make_mlx_recipe(spec, lora)
    return make_mlx_recipe(spec, lora, run.train, run.data)


def recipe_for(spec: ModelSpec, lora: LoraArgs, run: RunConfig | None = None) -> dict[str, Any]:
    """The recipe for `lora.stack` as a JSON-ready dict (`stack` says which); `run` gives
    the stacks whose config carries them (mlx-lm) the training hyperparameters."""
    return STACKS.get(lora.stack)(spec, lora, run)


def _grouped(rows: list[list[str]]) -> list[list[str]]:
    """Consecutive layers with identical cells merged into one 'a–b' row (48 layers → few)."""
    out: list[list[str]] = []
    for row in rows:
        if out and out[-1][1:] == row[1:]:
            out[-1][0] = f"{out[-1][0].split('–')[0]}–{row[0]}"
        else:
            out.append(list(row))
    return out


def render_recipe(console: Console, result: dict[str, Any]) -> None:
    """Print a recipe from `recipe_for` for people: the config, then what it covers."""
    if lora_stack(result["stack"]).runs_mlx:  # raw: valid YAML at any width (notes: comments)
        console.file.write(result["yaml"])
        return
    console.print(Syntax(result["snippet"], "python"))
    cov = result["coverage"]
    table = Table(*cov["table"]["header"], title="LoRA coverage by layer", title_justify="left")
    for row in _grouped(cov["table"]["rows"]):
        table.add_row(*row)
    console.print(table)
    console.print(
        f"coverage {cov['coverage']:.0%} of requested targets; trainable "
        f"{result['trainable_params']:,} ({result['trainable_fraction']:.2%}); "
        f"router {'adapted' if cov['router_adapted'] else 'frozen'}"
    )
    for kind, why in cov["not_present"].items():
        console.print(f"  {kind}: not present ({why})")
    for path, why in cov.get("not_targeted", {}).items():
        console.print(f"  {path}: not targeted ({why})")
    if "load" in result:
        _print_load(console, result["load"])


def _print_load(console: Console, load: dict[str, Any]) -> None:
    """Whether the peft config above trains the run as planned, then the API call that does."""
    if load["needs_moetune"]:
        console.print("\nthe peft config reaches these targets, but not as planned:")
    else:
        console.print("\nthe peft config trains it as planned; so does moetune.load:")
    for why in load["needs_moetune"]:
        console.print(f"  {why}", highlight=False)
    console.print()
    console.print(Syntax(load["code"], "python"))
