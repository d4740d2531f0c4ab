"""`moetune serve-plan`: will a model serve on a card with llama.cpp or vLLM, and how."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from moetune.cli.common import JsonOpt, app, console, emit_json, friendly
from moetune.errors import ConfigError, clip
from moetune.units import gib


@app.command(name="serve-plan")
@friendly
def serve_plan(
    model: Annotated[str, typer.Argument(help="Model (dir, catalog id, hub id): its config.json.")],
    engine: Annotated[str, typer.Option(help="llama.cpp | vllm.")],
    card: Annotated[
        list[str] | None, typer.Option("--card", help="Card id (repeatable; default: all).")
    ] = None,
    quant: Annotated[str, typer.Option(help="llama.cpp: GGUF type (Q4_K_M, Q8_0, BF16 …).")] = (
        "Q4_K_M"
    ),
    ctx: Annotated[int, typer.Option(help="llama.cpp: context length (-c).")] = 32768,
    kv_type: Annotated[str, typer.Option(help="llama.cpp: KV cache type (f16, q8_0, q4_0).")] = (
        "f16"
    ),
    max_model_len: Annotated[int, typer.Option(help="vLLM: --max-model-len.")] = 32768,
    max_loras: Annotated[int, typer.Option(help="vLLM: --max-loras (0: no --enable-lora).")] = 1,
    max_lora_rank: Annotated[int, typer.Option(help="vLLM: --max-lora-rank.")] = 16,
    gpu_memory_utilization: Annotated[
        float, typer.Option(help="vLLM: --gpu-memory-utilization.")
    ] = 0.9,
    tp: Annotated[int | None, typer.Option(help="vLLM: plan at this TP degree.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Serving memory per card: weights, KV cache, --n-cpu-moe (llama.cpp) or TP (vLLM)."""
    # lazy: the stage loads only when its command runs
    from moetune.model import load_spec
    from moetune.plan import card_ids
    from moetune.plan.serve.engines import get_engine, serve_plans

    get_engine(engine)  # a bad engine is reported before the model is read
    if model.lower().endswith(".gguf"):
        raise ConfigError(
            f"serve-plan reads a model's config.json, not a GGUF file ({clip(model, 80)})",
            "pass the model the GGUF was made from (dir, catalog id or hub id) with --quant",
        )
    spec = load_spec(model)
    plans = serve_plans(
        spec, card or card_ids(), engine, quant=quant, ctx=ctx, kv_type=kv_type,
        max_model_len=max_model_len, max_loras=max_loras, max_lora_rank=max_lora_rank,
        gpu_memory_utilization=gpu_memory_utilization, tensor_parallel=tp,
    )  # fmt: skip
    if as_json:
        emit_json(
            {
                "model": spec.name,
                "engine": engine,
                "cards": {c: p.to_json() for c, p in plans.items()},
            }
        )
        return
    console.print(_table(plans))
    for line in dict.fromkeys(n for p in plans.values() for n in p.notes):
        console.print(f"[dim]note:[/] {escape(line)}")


def _table(plans: dict[str, Any]) -> Table:
    first = next(iter(plans.values()))
    settings = ", ".join(f"{k}={v}" for k, v in first.settings.items())
    title = f"{first.model} on {first.engine} ({settings})"
    table = Table(title=title, title_justify="left")
    for col in (
        "card",
        "weights",
        "KV cache",
        "required",
        "budget",
        "fits",
        "n-cpu-moe / TP",
        "RAM",
    ):
        table.add_column(col, justify="left" if col == "card" else "right")
    for card_id, p in plans.items():
        how = p.n_cpu_moe if p.engine == "llama.cpp" else p.tensor_parallel
        table.add_row(
            card_id, gib(p.weights_bytes), gib(p.kv_cache_bytes), gib(p.required_bytes),
            gib(p.budget_bytes), "[green]yes[/]" if p.fits else "[red]no[/]",
            "-" if how is None else str(how), gib(p.cpu_ram_bytes) if p.cpu_ram_bytes else "-",
        )  # fmt: skip
    return table
