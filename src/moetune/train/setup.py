"""Everything a run settles before it loads the model: where and in what precision it
runs, the preflight gate (spec, memory plan, lint), the data, the aux-loss decision and
TRL's arguments – and, once all of that passed, the run directory's first files.

Nothing here trains, and nothing is written until every check has passed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from moetune.config import RunConfig, TrainArgs
from moetune.data import TrainData, check_sources, load_train_data
from moetune.data.load import Checked
from moetune.data.rendering import Rendering, template_source
from moetune.data.rungs import check_ladder
from moetune.data.summary import Summary, summarize
from moetune.data.tokenizer import run_tokenizer
from moetune.io import atomic_write_json
from moetune.lint import RULES
from moetune.lint.preflight import lint_run
from moetune.model import load_spec, to_hf_config
from moetune.model.weight_files import check_weight_files
from moetune.plan.planner import as_checkpointable
from moetune.plan.run_plan import RunPlan, plan_of_run
from moetune.train.errors import TrainError
from moetune.train.methods import method_of
from moetune.train.rundir.checkpoint import RunDir, open_run, versions
from moetune.train.rundir.recovery import ResumePoint, resume_point_of, set_aside
from moetune.train.vision import ImageCollator, check_first_row, load_processor

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from trl import SFTConfig

    from moetune.model.spec import ModelSpec
    from moetune.recipe.audit import CoverageReport
    from moetune.train.routing.select import ExpertSelection


# ---------------------------------------------------------------- device and precision

_DEVICES: dict[str, Callable[[], bool]] = {  # auto picks the first available, in this order
    "cuda": torch.cuda.is_available,
    "mps": lambda: bool(torch.backends.mps.is_available()),
    "cpu": lambda: True,
}


@dataclass(frozen=True)
class Placement:
    device: str  # cuda | mps | cpu
    precision: str  # bf16 | fp16 (auto on a card without bf16) | fp32

    def load_dtype(self, configured: str) -> str:
        """fp32 runs hold the base in float32; fp16 runs a bfloat16 base in float16 (the
        card has no bf16); bf16 runs in the configured model.dtype."""
        if self.precision == "fp16" and configured == "bfloat16":
            return "float16"
        return "float32" if self.precision == "fp32" else configured

    @property
    def device_name(self) -> str:
        """What the device calls itself ("NVIDIA H200"); "cpu" or "mps" off CUDA."""
        return torch.cuda.get_device_name() if self.device == "cuda" else self.device

    def to_json(self) -> dict[str, Any]:
        info: dict[str, Any] = {"device": self.device, "precision": self.precision}
        if self.device == "cuda":
            props = torch.cuda.get_device_properties(0)
            info.update(device_name=props.name, device_total_bytes=props.total_memory)
        return info


def deepspeed_rank() -> bool:
    """A rank of a DeepSpeed launch (`accelerate launch` sets this for distributed_type
    DEEPSPEED)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def device_args(device: str) -> dict[str, Any]:
    """TrainingArguments' device fields for a rank on `device`. accelerate skips its
    DeepSpeed path for use_cpu, yet on a host without CUDA a use_cpu=False rank runs on
    the CPU all the same; given the gloo backend (else accelerate counts a world of one),
    DeepSpeed's CPU accelerator then runs ZeRO-3 over gloo. DIST-SHARDED-CPU refuses
    device cpu beside a GPU, where use_cpu=False would take the GPU."""
    if device == "cpu" and deepspeed_rank() and not torch.cuda.is_available():
        return {"use_cpu": False, "ddp_backend": "gloo"}
    return {"use_cpu": device == "cpu"}


def resolve_placement(t: TrainArgs) -> Placement:
    """train.device / train.precision resolved: auto is bf16 on CUDA, fp32 elsewhere."""
    if t.device == "auto":
        device = next(name for name, available in _DEVICES.items() if available())
    elif _DEVICES[t.device]():
        device = t.device
    else:
        raise TrainError(
            f"train.device={t.device} but no {t.device} device is available here",
            "set train.device: auto (or cpu)",
        )
    precision = t.precision if t.precision != "auto" else auto_precision(device)
    return Placement(device, precision)


def auto_precision(device: str) -> str:
    """train.precision auto: bf16 on CUDA, fp16 on a CUDA card without bf16 (T4, V100; torch
    would emulate it, slowly), fp32 elsewhere."""
    if device != "cuda":
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"


# ---------------------------------------------------------------- the aux loss


@dataclass(frozen=True)
class AuxChoice:
    enabled: bool
    coef: float  # TRL's router_aux_loss_coef; 0.0 turns off what TRL would enable by itself
    reason: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def aux_choice(cfg: RunConfig, spec: ModelSpec) -> AuxChoice:
    """train.aux_loss when set; left unset, on exactly when the router trains."""

    has_aux = hasattr(to_hf_config(spec).get_text_config(), "output_router_logits")
    explicit = cfg.train.aux_loss is not None
    wanted = bool(cfg.train.aux_loss) if explicit else cfg.lora.train_router
    reason = "train.aux_loss" if explicit else ("lora.train_router" if wanted else "router frozen")
    if wanted and not has_aux:
        if explicit:
            raise TrainError(
                f"train.aux_loss=true but {spec.model_type} has no load-balancing aux loss",
                "leave train.aux_loss unset (or false) for this model",
            )
        return AuxChoice(False, 0.0, f"{spec.model_type} has no aux loss")
    return AuxChoice(wanted, cfg.train.aux_loss_coef if wanted else 0.0, reason)


# ---------------------------------------------------------------- the settled run


@dataclass
class Setup:
    """What preflight settled; `coverage` is filled in once the model is wrapped, `selection`
    (lora.expert_selection) once the experts are scored."""

    place: Placement
    spec: ModelSpec
    findings: list[Any]
    plan: Any  # moetune.plan.MemoryPlan: the preflight's, one device holding every weight
    overridden: list[str]  # error findings trained through with allow_errors
    tokenizer: PreTrainedTokenizerBase
    data: TrainData
    eval_data: TrainData | None
    aux: AuxChoice
    args: SFTConfig
    resume_from: tuple[int, Path] | None
    damaged: ResumePoint | None = None  # resume: checkpoints newer than resume_from that fail
    notes: list[str] = dataclasses.field(default_factory=list)  # said once the run starts
    engine: str = "peft"  # lora.engine as resolved for this model (engine/resolve.py)
    stored: str | None = None  # the format a base published quantised is stored in (stored.py)
    load_dtype: str = "float32"  # model.dtype as the base really loads (Placement.load_dtype)
    coverage: CoverageReport | None = None
    selection: ExpertSelection | None = None
    data_summary: Summary | None = None  # the one line `moetune train` prints of the data
    processor: Any = None  # image+text rows: the checkpoint's processor (vision.py)
    run_plan: RunPlan | None = None  # the plan of the configuration that runs (planned.py)

    @property
    def planned_peak_bytes(self) -> int | None:
        return self.run_plan.peak_bytes if self.run_plan is not None else None

    def preflight_json(self) -> dict[str, Any]:
        return {
            "findings": [f.to_json() for f in self.findings],
            "errors_overridden": self.overridden,
            "plan": self.plan.to_json() if self.plan is not None else None,
            "run_plan": self.run_plan.to_json() if self.run_plan is not None else None,
            "aux_loss": self.aux.to_json(),
        }


@dataclass(frozen=True)
class Base:
    """What a run settles about its base before any data: `cfg` as it trains (checkpointing
    off where the family refuses it), the preflight's findings and plan, the resolved engine
    and stored format, and the plan of the configuration that runs."""

    cfg: RunConfig
    place: Placement
    spec: ModelSpec
    findings: list[Any]
    plan: Any  # moetune.plan.MemoryPlan
    overridden: list[str]
    engine: str
    stored: str | None
    load_dtype: str
    run_plan: RunPlan | None
    notes: list[str]


def settle_base(cfg: RunConfig, place: Placement, allow_errors: bool) -> Base:
    """The spec, weight files, preflight (lint + plan), engine, stored format and offload
    checks – everything `load_model` needs; `moetune train` and the Python API share it."""
    # lazy: heavy to import (moetune)
    from moetune.engine.resolve import resolve_engine
    from moetune.train.offload import check_offload, local_dir
    from moetune.train.routing.select import check_selection
    from moetune.train.stored import check_stored, own_reader

    spec = load_spec(cfg.model.id, cfg.model.trust_remote_code)
    # a damaged local base: one line, no run dir; a stray weight file beside it: named
    ignored = check_weight_files(cfg.model.id, own_reader(cfg, spec))
    cfg, gc_off = as_checkpointable(cfg, spec)  # jetmoe refuses it: off, and said
    check_selection(cfg.lora, spec)
    run_cfg = as_run(cfg, place)  # the dtype the base loads in, decided here once
    findings, plan, overridden = preflight(run_cfg, allow_errors, spec)
    base = cfg.model  # the engine, after the lint said why
    engine = resolve_engine(spec, cfg.lora, base.experts_dtype, base.quantized_base)
    stored = check_stored(cfg, spec, engine)  # a published FP8 / FP4 base: keys, shapes
    check_offload(cfg, engine, local_dir(cfg.model.id))  # train.offload: refused up front
    run_plan = plan_of_run(spec, run_cfg, place.device, plan)  # offload, nproc
    return Base(cfg, place, spec, findings, plan, overridden, engine, stored,
                run_cfg.model.dtype, run_plan, ignored + gc_off)  # fmt: skip


def prepare(cfg: RunConfig, run: RunDir, resume: bool, allow_errors: bool) -> Setup:
    """Placement, preflight, data and TRL arguments; then the run dir's first files."""
    place = resolve_placement(cfg.train)
    method = method_of(cfg)
    rows = check_data(cfg, method.formats)  # bad data stops before any model is built
    settled = settle_base(cfg, place, allow_errors)
    cfg, spec = settled.cfg, settled.spec
    # lint's TOKENIZER, refused here in `moetune data`'s line (before any weight loads)
    tokenizer = run_tokenizer(cfg, spec.vocab_size, rows[0][0] if rows[0] else None)
    data, eval_data = load_train_data(
        cfg.data, tokenizer, cfg.train.seq_len, method.formats, cfg.train.seed, rows
    )
    method.check(cfg, data)
    processor, seen = image_processor(cfg, data, tokenizer)  # image rows: the checkpoint's
    summary = summarize(cfg, tokenizer, method.formats, rows)  # what announce() says of it
    summary.refuse_no_loss()  # nothing to learn from: stopped before any weight loads
    aux = aux_choice(cfg, spec)
    args = trl_args(cfg, run, place, aux, data, eval_data is not None)
    point = resume_point(run, data) if resume else None
    setup = Setup(
        place=place,
        spec=spec,
        findings=settled.findings,
        plan=settled.plan,
        overridden=settled.overridden,
        tokenizer=tokenizer,
        data=data,
        eval_data=eval_data,
        aux=aux,
        args=args,
        resume_from=point.checkpoint if point else None,
        damaged=point,
        engine=settled.engine,
        stored=settled.stored,
        load_dtype=settled.load_dtype,
        data_summary=summary,
        notes=settled.notes + seen,
        processor=processor,
        run_plan=settled.run_plan,
    )
    with args.main_process_first(local=False, desc="moetune run dir"):  # the others wait
        if args.should_save:
            write_preamble(run, cfg, setup)
    return setup


def image_processor(
    cfg: RunConfig, data: TrainData, tokenizer: PreTrainedTokenizerBase
) -> tuple[Any, list[str]]:
    """(the checkpoint's processor, what to say of it) for image+text rows, checked on the
    first row; (None, []) for text rows. model.tokenizer replaces the processor's own."""
    if not data.images:
        return None, []
    processor, notes = load_processor(cfg.model.id, cfg.data.chat_template)
    if cfg.model.tokenizer:  # the one the run checked, not the checkpoint dir's
        processor.tokenizer = tokenizer
    collator = ImageCollator(processor, cfg.train.seq_len, cfg.data.completion_only_loss)
    check_first_row(collator, data.dataset, data.path)
    return processor, notes


def check_streaming(cfg: RunConfig) -> None:
    """A streamed set has no length, so the run needs a step count."""
    if cfg.data.streaming and not cfg.train.max_steps:
        raise TrainError(
            "data.streaming reads rows lazily, so the number of steps is not known",
            "set train.max_steps (or data.streaming: false)",
        )


def check_data(cfg: RunConfig, formats: tuple[str, ...]) -> Checked:
    """The data checks `moetune train` and `moetune data` both run before a tokenizer loads
    (one function: the preview never passes what training refuses): a streamed set needs
    train.max_steps; every row of every source read and checked (data.streaming: a head);
    the eval ladder's kinds, rung files and rows, as lint's EVAL-LADDER checks them."""
    check_streaming(cfg)
    check_ladder(cfg.eval)  # an eval that would fail is found before the spend, not after
    return check_sources(cfg.data, formats)


def preflight(
    cfg: RunConfig, allow_errors: bool, spec: ModelSpec | None = None
) -> tuple[list[Any], Any, list[str]]:
    """Lint and plan the run as it will really run (`cfg` in its load dtype: `as_run`), on
    its spec when the caller has it; an error finding stops it."""
    findings, plan = lint_run(cfg, spec=spec)
    enforced = {rule_id for rule_id, rule in RULES.items() if rule.enforced}  # said later
    errors = [f for f in findings if f.severity == "error" and f.rule_id not in enforced]
    if errors and not allow_errors:
        more = f" (and {len(errors) - 1} more: {', '.join(f.rule_id for f in errors[1:])})"
        raise TrainError(
            f"[{errors[0].rule_id}] {errors[0].message}{more if len(errors) > 1 else ''}",
            f"{errors[0].fix} – or pass --allow-errors to train anyway (it is recorded)",
        )
    return findings, plan, [f.rule_id for f in errors]


def as_run(cfg: RunConfig, place: Placement) -> RunConfig:
    """`cfg` in the dtype the base really loads in (fp32 runs hold it in float32)."""
    dtype = place.load_dtype(cfg.model.dtype)
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"dtype": dtype})})


# ---------------------------------------------------------------- TRL's arguments

_SCHEDULERS = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}


def _checkpointing(on: bool) -> dict[str, Any]:
    """transformers 5.24 renamed gradient_checkpointing (the old name warns); 5.23 has only it."""
    # lazy: heavy to import (transformers)
    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    new = "activation_checkpointing"
    return {new if new in names else "gradient_checkpointing": on}


def _project() -> dict[str, Any]:
    """The project trackio files the run under (transformers 5.24; 5.23 has no field)."""
    # lazy: heavy to import (transformers)
    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {"project": "moetune"} if "project" in names else {}


def trl_args(
    cfg: RunConfig, run: RunDir, place: Placement, aux: AuxChoice, data: TrainData, has_eval: bool
) -> SFTConfig:
    """The TRL config of the run's train.method (SFTConfig, DPOConfig, GRPOConfig): the
    fields they share, then the method's own. Checkpoints go to the staging dir."""
    method = method_of(cfg)
    config = method.classes()[1]
    fields = shared_args(cfg, run, place, aux, has_eval) | method.args(cfg, data)
    return cast("SFTConfig", config(**fields))


def shared_args(
    cfg: RunConfig, run: RunDir, place: Placement, aux: AuxChoice, has_eval: bool
) -> dict[str, Any]:
    """TrainingArguments fields every method's TRL config takes."""
    t = cfg.train
    return dict(
        output_dir=str(run.staging),
        per_device_train_batch_size=t.batch_size,
        gradient_accumulation_steps=t.grad_accum,
        learning_rate=t.learning_rate,
        weight_decay=t.weight_decay,  # optimizer: AdamW (transformers' default, torch fused)
        lr_scheduler_type=_SCHEDULERS[t.lr_scheduler],
        warmup_steps=t.warmup_ratio,  # a float in [0, 1) is a ratio of the total steps
        num_train_epochs=t.epochs,
        max_steps=t.max_steps or -1,
        seed=t.seed,
        data_seed=t.seed,
        bf16=place.precision == "bf16",
        fp16=place.precision == "fp16",  # loss scaling; LoRA factors stay fp32 (peft's cast)
        **device_args(place.device),
        logging_steps=t.logging_steps,
        logging_nan_inf_filter=False,  # a NaN loss must show (and stop the run), not be averaged
        save_strategy="steps",
        save_steps=t.save_steps,
        eval_strategy="steps" if has_eval else "no",
        eval_steps=t.save_steps,
        router_aux_loss_coef=aux.coef,
        include_num_input_tokens_seen="non_padding",  # tokens/s, restored on resume
        report_to=list(cfg.output.report_to),  # transformers' integrations (trackers.py)
        run_name=run.root.name,  # the name trackers show
        **_project(),
        disable_tqdm=True,  # moetune draws its own progress bar
        **_checkpointing(t.gradient_checkpointing),
    )


# ---------------------------------------------------------------- the run dir


def resume_point(run: RunDir, data: TrainData) -> ResumePoint:
    """The last whole checkpoint, once the data is known to be what the run started on."""
    if run.data.is_file():
        before = json.loads(run.data.read_text(encoding="utf-8")).get("sha256")
        if before and before != data.sha256:
            raise TrainError(
                f"--resume with different data: {data.path} changed since the run started",
                "restore the original data file, or start a new output.dir",
            )
    return resume_point_of(run)


def write_preamble(run: RunDir, cfg: RunConfig, setup: Setup) -> None:
    """config.yaml, versions.json, preflight.json and data.json, before any training."""
    if setup.damaged is not None:  # renamed, never deleted: the user may want them
        setup.notes += set_aside(setup.damaged)
    open_run(run, cfg, setup.resume_from[0] if setup.resume_from else None)
    atomic_write_json(run.versions, {**versions(), **setup.place.to_json()})
    atomic_write_json(run.preflight, setup.preflight_json())
    preview = {"preview": setup.data_summary.to_json()} if setup.data_summary else {}
    rendering = {"rendering": rendering_of(cfg, setup).to_json()}  # what the eval renders by
    atomic_write_json(run.data, setup.data.to_json() | preview | rendering)


def rendering_of(cfg: RunConfig, setup: Setup) -> Rendering:
    """How the run's rows became text (chat template or as written), for data.json."""
    first = (setup.data.head(1) or [{}])[0]
    source = template_source(cfg.data.chat_template, cfg.model.id)
    return Rendering.of_run(setup.data.format, first, setup.tokenizer, source)
