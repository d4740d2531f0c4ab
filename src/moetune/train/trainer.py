"""`train(cfg)`: LoRA SFT, DPO or GRPO (train.method) of an MoE model that provably
reaches the experts.

The run, top to bottom:

1. output.ledger is checked, the run dir locked (one writer at a time, lock.py) and
   checked read-only: a finished run is never overwritten, an unfinished one only
   continued with `resume=True`, with the same config and data, from its newest whole
   checkpoint (recovery.py);
2. `setup.prepare`: device and precision (bf16 on CUDA, fp32 elsewhere unless
   train.precision says so); preflight – the spec, a memory plan for the run as it will
   really run and the lint rules, where an `error` finding stops the run unless
   `allow_errors`, which is recorded; every data row checked; TRL's arguments; then the
   run dir's first files (config, versions + git sha, preflight, data);
3. the model is loaded, wrapped with the recipe's LoRA config and audited: coverage.json,
   and the run stops unless every requested target got LoRA;
4. with lora.expert_selection (ESFT), the frozen base scores the experts on the trainer's
   tokenised rows and only the chosen experts' LoRA trains (train/routing/select.py;
   experts_selected.json, reused on resume);
5. train.method's TRL trainer (methods.py: SFTTrainer, DPOTrainer, GRPOTrainer; the
   reference policy is the adapter disabled, never a copy) trains with moetune's callbacks
   (metrics, routing judged against the base's own routing measured just before, GRPO's
   rollout → training routing shift, atomic checkpoints, progress). The aux loss
   is on only when train.aux_loss says so or, left unset, when lora.train_router – TRL
   would otherwise turn it on for every MoE by itself;
6. the adapter is saved in peft format (temp dir, then rename), the router's effective
   weights are compared with their state before training, and summary.json comes last.

Multi-GPU is accelerate's job: `moetune train run.yaml --nproc N` (launch.py) or
`accelerate launch -m moetune train run.yaml` runs this unchanged on every rank. Only the
main process ledgers and writes the run dir; checkpoints are committed after every process
saved its part.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from rich.console import Console
from rich.markup import escape

from moetune.config import RunConfig
from moetune.config.keys import offload_mode
from moetune.config.paths import anchor
from moetune.io import atomic_write_json
from moetune.ledger import attempt
from moetune.lint.preflight import check_ledger
from moetune.model.saved_names import write_checkpoint_named
from moetune.plan.cost.estimate import step_signature
from moetune.plan.hardware import card_for_device
from moetune.train.base_files import BaseFilesCallback, base_identity, check_unchanged
from moetune.train.callbacks import (
    ZERO_LOSS_STEPS,
    MetricsCallback,
    RichProgress,
    peak_memory,
    quiet,
    reset_peak_memory,
)
from moetune.train.distributed.ep_balance import balance_experts
from moetune.train.distributed.ep_memory import against_plan
from moetune.train.distributed.ep_padding import pad_alike
from moetune.train.distributed.ep_state import ep_trainer
from moetune.train.distributed.ep_unused import unreached_trainer
from moetune.train.distributed.nodes import node_loss_stops, world
from moetune.train.distributed.sharded_load import adapter_only_saves, from_main, install
from moetune.train.distributed.zero3_load import base_load, gathered_forward
from moetune.train.errors import TrainError
from moetune.train.grpo.adapter_live import LiveCheck
from moetune.train.grpo.rewards import reward_warnings
from moetune.train.grpo.shift import ShiftCallback, ShiftRecorder
from moetune.train.launch import fsdp_on_cpu, launched, sharding
from moetune.train.methods import method_of
from moetune.train.model import load_model, wrap_lora
from moetune.train.offload import store_meter, write_offload_json
from moetune.train.result import TrainResult, finished_result
from moetune.train.routing.recorder import (
    LayerLoad,
    RoutingCallback,
    RoutingRecorder,
    compare_router,
    router_weights,
    summarize,
)
from moetune.train.routing.rows import base_sample
from moetune.train.rundir.checkpoint import (
    RunDir,
    inspect_run,
    ledger_fields,
    replace_dir,
)
from moetune.train.rundir.lock import hold
from moetune.train.rundir.recovery import CheckpointCommitter, disk_full_stops
from moetune.train.setup import Setup, prepare
from moetune.train.stacks import stack_trainer
from moetune.train.trackers import (
    TrackerCallback,
    check_tracker_dirs,
    check_trackers,
    fan_out,
    tracking,
)
from moetune.train.vision import processor_line, processor_source, vision_kwargs

if TYPE_CHECKING:
    from torch import nn
    from trl import SFTTrainer

    from moetune.train.routing.select import ExpertSelection


def train(
    cfg: RunConfig,
    *,
    resume: bool = False,
    allow_errors: bool = False,
    overwrite: bool = False,
    overwrite_promoted: bool = False,
    progress: bool = True,
) -> TrainResult:
    """Train the LoRA adapter `cfg` describes; the module docstring lists the steps.
    `overwrite` replaces a finished run in output.dir (only after preflight passes; only
    moetune's files; a promoted adapter only with `overwrite_promoted`).
    Every attempt – finished, failed, interrupted or terminated – leaves one ledger row, and
    only one process at a time writes a run dir (lock.py)."""
    replace = (overwrite or overwrite_promoted, overwrite_promoted)
    cfg = anchor(cfg)  # the run dir names no place relative to where it was started
    if resume and (done := finished_result(cfg)) is not None:
        return done  # already complete: nothing attempted, no second ledger row
    require_launcher(cfg)
    check_trackers(cfg.output.report_to)  # a missing package: one line, nothing built
    check_tracker_dirs(cfg.output.report_to)  # or an unwritable folder of theirs
    if launched():  # an FSDP launch's CPU ranks shard for real, not silently as DDP
        fsdp_on_cpu()
        install()  # a sharded load: rank 0's full tensors freed once sent, the load measured
    run_stack = stack_trainer(cfg.lora.stack)  # registered in stacks.py (peft: _train here)

    def run() -> TrainResult:
        with node_loss_stops(cfg):  # a dead node's peers: one line, also in the ledger row
            return cast(TrainResult, run_stack(cfg, resume, allow_errors, replace, progress))

    if int(os.environ.get("RANK", "0")) != 0:  # under accelerate only the main process ledgers
        return run()
    check_ledger(cfg.output.ledger)
    with (
        attempt(cfg.output.ledger, "train", **ledger_fields(cfg)) as row,
        hold(Path(cfg.output.dir)),
    ):
        row["metrics"]["method"] = cfg.train.method  # failed attempts say what they trained
        result = run()
        row["metrics"] = result.to_json()
    return result


def require_launcher(cfg: RunConfig) -> None:
    """train.nproc > 1 (or nnodes > 1) runs in the processes a launcher starts, never
    silently in one."""
    if world(cfg.train) > 1 and not launched():
        raise TrainError(
            f"train.nproc={cfg.train.nproc} × train.nnodes={cfg.train.nnodes} but this is a "
            "single process, not a launched rank",
            "run `moetune train run.yaml` (it starts the processes) or `accelerate launch`",
        )


def _train(
    cfg: RunConfig,
    resume: bool,
    allow_errors: bool,
    replace: tuple[bool, bool],  # (overwrite, overwrite_promoted)
    progress: bool,
) -> TrainResult:
    started = time.perf_counter()
    run = inspect_run(cfg, resume, *replace)
    console = Console(stderr=True, quiet=not progress)
    setup = prepare(cfg, run, resume, allow_errors)
    files = base_identity(cfg.model.id)  # compared before each save
    with base_load(setup.args, cfg, setup.spec) as loaded:  # ZeRO-3: partitioned as it loads
        base = loaded(load_model(cfg, setup.place, setup.engine, setup.stored, setup.load_dtype))
        model, setup.coverage = wrap_lora(base, cfg, run, setup)
    announce(console, cfg, setup)
    # a sharded load: only the main process holds the base's values until prepare()
    router_before = from_main(lambda: router_weights(model, setup.spec))
    with tracking(cfg.output.report_to, run.root):  # their files under the run dir
        trainer, routing = build_trainer(cfg, setup, run, model, console)
        trainer.add_callback(BaseFilesCallback(files))
        shift = callback_of(trainer, ShiftCallback)
        rows, collate = method_of(cfg).routing_rows(trainer, setup.tokenizer)
        batch, limit = base_sample(
            cfg.train.batch_size, cfg.train.seq_len, offload_mode(cfg.train.offload).streams
        )
        with gathered_forward(model):  # ZeRO-3: one decoder layer whole at a time
            routing.base = from_main(
                lambda: routing.measured_base(model, rows, collate, batch, limit)
            )
        balance_experts(cfg, setup, run, model, routing.base)  # train.ep_placement balanced
        setup.selection = select_experts(cfg, setup, run, model, trainer, console)
        with disk_full_stops(run):
            fit(trainer, setup, console)
            routing.recorder.remove()
            if shift:
                shift.recorder.remove()
            check_unchanged(files, "before the final adapter was saved")
            setup.notes += save_adapter(trainer, run)
            # train.offload: what the expert store measured (under ep: every rank's, on rank 0)
            write_offload_json(run, model, setup.args.should_save)
    if routing.every:
        console.print(escape(routing.drift()["line"]), highlight=False)
    router = compare_router(router_before, router_weights(model, setup.spec), cfg.lora.train_router)
    result = TrainResult(
        run_dir=str(run.root),
        adapter_dir=str(run.adapter),
        steps=trainer.state.global_step,
        final_loss=final_loss(trainer),
        coverage=setup.coverage.coverage,
        router_changed=router["changed"],
        seconds=round(time.perf_counter() - started, 3),
        peak_memory_bytes=peak_memory()[0],
        planned_peak_bytes=setup.planned_peak_bytes,
        planned_by=setup.run_plan.label if setup.run_plan else None,
        aux_loss=setup.aux.enabled,
        method=cfg.train.method,
        routing_shift=shift.summary()["mean_shift"] if shift else None,
        resumed_from_step=setup.resume_from[0] if setup.resume_from else None,
        errors_overridden=setup.overridden,
        warnings=setup.notes
        + routing.warnings
        + router_warnings(router)
        + selection_warnings(model, setup)
        + (shift.warnings if shift else [])
        + reward_warnings(trainer),
        **throughput(cfg, setup, trainer),
    )
    ran = sharding(trainer)  # on every rank: ep gathers each rank's placement
    ran = against_plan(ran, setup.run_plan.peak_bytes if setup.run_plan else None)
    if setup.args.should_save:
        checks = {"router": router, "routing_drift": routing.drift(), "dist": ran}
        write_summary(run, result, checks | ({"shift": shift.summary()} if shift else {}), setup)
    return result


def announce(console: Console, cfg: RunConfig, setup: Setup) -> None:
    """One line on what is about to train, the router and aux-loss choice included."""
    report, aux = setup.coverage, setup.aux
    assert report is not None
    router = "trainable (LoRA)" if cfg.lora.train_router else "frozen"
    aux_text = f"on, coef {aux.coef}" if aux.enabled else "off"
    line = (
        f"[bold]train[/] {escape(setup.spec.name)} on {setup.place.device} "
        f"({setup.place.precision}) · {setup.data.rows} {setup.data.format} rows, loss on "
        f"{escape(setup.data.loss.on)} · LoRA on {report.adapted}/{report.expected} targets "
        f"({setup.engine} engine) · router {router} · aux loss {aux_text} ({aux.reason})"
    )
    console.print(line, highlight=False)
    stored = setup.plan.stored if setup.plan is not None else None
    if stored:  # a published quantised base: how its experts are held
        console.print(escape(stored["text"]), highlight=False)
    if setup.data_summary is not None:
        console.print(escape(setup.data_summary.one_line()), highlight=False)
    if setup.processor is not None:  # image rows: the checkpoint's processor, and how loaded
        console.print(escape(processor_line(setup.processor)), highlight=False)
    for note in setup.notes:
        console.print(f"[yellow]warning:[/] {escape(note)}", highlight=False)
    if setup.resume_from:
        console.print(f"resuming from checkpoint step {setup.resume_from[0]}")
    for rule_id in setup.overridden:
        console.print(f"[yellow]warning:[/] training despite preflight error {rule_id}")


# ---------------------------------------------------------------- training


def build_trainer(
    cfg: RunConfig, setup: Setup, run: RunDir, model: nn.Module, console: Console
) -> tuple[SFTTrainer, RoutingCallback]:
    """train.method's TRL trainer (methods.py) on the wrapped model, with moetune's
    callbacks instead of printing; its reference policy is the adapter disabled."""
    # lazy: heavy to import (peft, transformers)
    from peft import PeftModel
    from transformers import PrinterCallback

    method = method_of(cfg)
    kwargs = {
        "model": cast(PeftModel, model),
        "args": setup.args,
        "train_dataset": setup.data.dataset,
        "eval_dataset": setup.eval_data.dataset if setup.eval_data else None,
        "processing_class": setup.tokenizer,
        **method.trainer_kwargs(cfg),
        **vision_kwargs(cfg, setup.processor),  # image+text rows: the processor, our collator
    }
    with quiet():
        trainer = method.build(method.classes()[0], kwargs)
    trainer.remove_callback(PrinterCallback)  # disable_tqdm swaps the bar for log printing
    adapter_only_saves(trainer)  # FSDP: a save gathers the LoRA, not the whole base
    ep_trainer(trainer)  # ep: sliced expert LoRA saved, loaded and clipped whole
    unreached_trainer(trainer)  # ep_degree: what no rank's backward reached skips the step
    pad_alike(trainer)  # ep: every rank's micro-batch as wide as one process's batch
    feed = tracker_feed(cfg, setup, trainer, lambda: routing.base)
    routing = RoutingCallback(
        RoutingRecorder(model, setup.spec),
        cfg.train.routing_every,
        fan_out(run.routing.append, *([feed.routing] if feed else [])),
        lambda message: console.print(f"[yellow]warning:[/] {escape(message)}"),
    )
    meter = store_meter(model)  # train.offload: what each step read, and what bound it
    zero_stop = 0 if method.rollout else ZERO_LOSS_STEPS  # GRPO: 0 when rewards tie
    extra = meter.totals if meter else None
    metrics = MetricsCallback(run.metrics.append, extra=extra, zero_stop=zero_stop)
    shift = rollout_shift(cfg, setup, run, model, console, feed)
    # shift first: its on_log puts the shift into the loss row that metrics then writes
    callbacks = (*shift, metrics, routing, *([feed] if feed else []), CheckpointCommitter(run))
    bar = RichProgress(metrics, console, meter.line if meter else None)
    for callback in (*callbacks, bar):  # the bar shows the row
        trainer.add_callback(callback)  # metrics just made; the feed logs what routing saw
    return trainer, routing


def tracker_feed(
    cfg: RunConfig, setup: Setup, trainer: SFTTrainer, base: Callable[[], dict[int, LayerLoad]]
) -> TrackerCallback | None:
    """output.report_to: moetune's MoE metrics through the Trainer's own log, so every
    integration gets them. transformers' Trainer.log, not TRL's override: that one would
    flush the metrics TRL averages for the next loss row into this one."""
    if not cfg.output.report_to:
        return None
    # lazy: heavy to import (transformers)
    from transformers import Trainer

    return TrackerCallback(lambda row: Trainer.log(trainer, row), base, setup.planned_peak_bytes)


def rollout_shift(
    cfg: RunConfig, setup: Setup, run: RunDir, model: nn.Module, console: Console,
    feed: TrackerCallback | None = None,
) -> tuple[ShiftCallback, ...]:  # fmt: skip
    """Methods that sample (grpo): the rollout → training routing shift, per step."""
    if not method_of(cfg).rollout:
        return ()
    return (
        ShiftCallback(
            ShiftRecorder(model, setup.spec, cfg.train.grpo.routing_replay == "replay"),
            cfg.train.grpo.shift_warn,
            fan_out(run.shift.append, *([feed.shift] if feed else [])),
            lambda message: console.print(f"[yellow]warning:[/] {escape(message)}"),
            # rollouts from the policy? (one rank's extra forward would hang a sharded run)
            None if launched() else LiveCheck(model, cfg.train.grpo.temperature),
        ),
    )


def select_experts(
    cfg: RunConfig, setup: Setup, run: RunDir, model: nn.Module, trainer: SFTTrainer,
    console: Console,
) -> ExpertSelection | None:  # fmt: skip
    """lora.expert_selection: score the experts on the rows the trainer will train on, then
    let only the chosen ones' LoRA train. A resumed run keeps the experts it started with."""
    if cfg.lora.expert_selection == "all":
        return None
    # lazy: heavy to import (moetune)
    from moetune.train.routing import select

    path = run.root / select.FILE
    if setup.resume_from and path.is_file():
        chosen = select.ExpertSelection.from_json(json.loads(path.read_text(encoding="utf-8")))
    else:
        dataset, collate = trainer.train_dataset, trainer.data_collator
        with gathered_forward(model):  # ZeRO-3: one decoder layer whole at a time
            chosen = from_main(lambda: select.select_experts(
                model, setup.spec, cfg.lora, dataset, collate, cfg.train.batch_size
            ))  # fmt: skip
    select.restrict_training(model, setup.spec, chosen)
    if setup.args.should_save:
        atomic_write_json(path, chosen.to_json())
    console.print(chosen.describe(), highlight=False)
    return chosen


def fit(trainer: SFTTrainer, setup: Setup, console: Console) -> None:
    """trainer.train(), resumed from the last committed checkpoint when there is one."""
    checkpoint = str(setup.resume_from[1]) if setup.resume_from else None
    reset_peak_memory()
    try:
        with quiet():
            trainer.train(resume_from_checkpoint=checkpoint)
    finally:  # a crash must not leave the live progress display behind
        if (bar := callback_of(trainer, RichProgress)) is not None:
            bar.close()


_C = TypeVar("_C")


def callback_of(trainer: SFTTrainer, kind: type[_C]) -> _C | None:
    """The trainer's callback of this class (moetune adds one of each)."""
    return next((c for c in trainer.callback_handler.callbacks if isinstance(c, kind)), None)


def throughput(cfg: RunConfig, setup: Setup, trainer: SFTTrainer) -> dict[str, Any]:
    """The TrainResult fields a launch estimates from: tokens/s of the loop, on which device
    and card, for which step (`step_signature`)."""

    metrics = callback_of(trainer, MetricsCallback)
    devices = setup.args.world_size * max(1, setup.args.n_gpu)  # n_gpu > 1: DataParallel
    device = setup.place.device_name
    return {
        **(metrics.loop if metrics is not None else {}),
        "device": device,
        "card": card_for_device(device),
        "signature": step_signature(cfg, setup.engine, devices),
    }


# ---------------------------------------------------------------- outputs


def save_adapter(trainer: SFTTrainer, run: RunDir) -> list[str]:
    """The peft adapter into a temp dir, its keys in the checkpoint's own names, then
    renamed to adapter/ in one step; notes on what peft will not load back."""
    notes: list[str] = []
    tmp = run.root / ".adapter.tmp"
    if trainer.args.should_save:
        shutil.rmtree(tmp, ignore_errors=True)
    trainer.save_model(str(tmp))  # every process: sharded weights are gathered; main writes
    if trainer.args.should_save:
        (tmp / "training_args.bin").unlink(missing_ok=True)  # a pickle has no place there
        notes = write_checkpoint_named(tmp, trainer.model)
        replace_dir(tmp, run.adapter)
    return notes


def router_warnings(router: dict[str, Any]) -> list[str]:
    if router["changed"] and not router["trainable"]:
        return [f"the router changed although it was frozen (layers {router['changed_layers']})"]
    return []


def selection_warnings(model: nn.Module, setup: Setup) -> list[str]:
    """An unselected expert whose LoRA moved: its update is no longer zero as promised."""
    if setup.selection is None:
        return []
    # lazy: heavy to import (moetune)
    from moetune.train.routing.select import changed_unselected

    layers = changed_unselected(model, setup.spec, setup.selection)
    return [f"unselected experts' LoRA changed (layers {layers})"] if layers else []


def final_loss(trainer: SFTTrainer) -> float | None:
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    return float(losses[-1]) if losses else None


def memory_json(setup: Setup, measured: int) -> dict[str, Any]:
    """The measured peak (the result's: read once, so the two agree) next to the plan of
    the configuration that ran (offload, nproc, quantised experts: plan/run_plan.py), saying
    which planned figure it is compared with and how the peak was measured."""
    how = peak_memory()[1]
    plan = setup.run_plan
    planned = plan.peak_bytes if plan else None
    return {
        "measured_peak_bytes": measured,
        "measured": how,
        "planned_peak_bytes": planned,
        "planned_required_bytes": plan.required_bytes if plan else None,
        "measured_over_planned": round(measured / planned, 4) if planned else None,
        "planned_by": plan.kind if plan else None,  # offload | per_rank | memory
        "compared": plan.compared if plan else None,
        "planned_components": plan.components if plan else {},
    }


def write_summary(run: RunDir, result: TrainResult, checks: dict[str, Any], setup: Setup) -> None:
    """summary.json, last: its presence marks the run finished. `checks`: the router's
    before/after comparison ("router") and the routing against the base's ("routing_drift")."""
    summary = {
        "result": result.to_json(),
        "router": checks["router"],
        "aux_loss": setup.aux.to_json(),
        "routing": {**summarize(run.routing.read()), **checks["routing_drift"]},
        "memory": memory_json(setup, result.peak_memory_bytes),
        "placement": setup.place.to_json(),
        "data": setup.data.to_json(),
        "coverage_by_kind": setup.coverage.to_json()["by_kind"] if setup.coverage else {},
        "engine": setup.engine,  # lora.engine as resolved (auto -> moetune | peft)
    }
    if setup.processor is not None:  # image rows: class and how it loaded (AutoProcessor?)
        summary["processor"] = processor_source(setup.processor)
    if checks["dist"]:  # --nproc: what accelerate ran and this rank's share of the model
        summary["distributed"] = checks["dist"]
    if "shift" in checks:  # grpo: rollout → training routing shift (routing_shift.jsonl)
        summary["routing_shift"] = checks["shift"]
    if setup.selection is not None:  # experts_selected.json has the scores per layer
        summary["expert_selection"] = setup.selection.summary()
    quant = run.root / "quant.json"  # quantised experts: bytes and output error per layer
    if quant.is_file():
        summary["quant"] = json.loads(quant.read_text(encoding="utf-8"))
    offload = run.root / "offload.json"  # train.offload: peak expert bytes, bytes moved
    if offload.is_file():
        summary["offload"] = json.loads(offload.read_text(encoding="utf-8"))
    atomic_write_json(run.summary, summary)
    shutil.rmtree(run.staging, ignore_errors=True)  # empty once every checkpoint is committed
