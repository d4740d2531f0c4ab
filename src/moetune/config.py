"""The run config: typed sections grouped by concern, loaded from YAML with
`--set section.field=value` overrides (CLI beats YAML beats defaults)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from moetune.errors import ConfigError

Target = Literal["attention", "experts", "dense", "shared", "router"]
DEFAULT_TARGETS: tuple[Target, ...] = ("attention", "experts", "dense", "shared")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelArgs(_Section):
    """Which base model to fine-tune."""

    id: str = Field(
        "Qwen/Qwen3-30B-A3B",
        description="Local dir/file with config.json, a bundled catalog id, or a hub id.",
    )
    format: Literal["hf", "gguf"] = Field(
        "hf", description="Weight format of the base; gguf bases cannot be trained."
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="Dtype the frozen base weights are held in."
    )

    @property
    def is_gguf(self) -> bool:
        """A GGUF base, by declared format or by file name."""
        return self.format == "gguf" or self.id.lower().endswith(".gguf")


class LoraArgs(_Section):
    """The LoRA adapter: where it goes and how big it is."""

    rank: int = Field(16, description="LoRA rank r (per expert for expert stacks).")
    alpha: float | None = Field(None, description="LoRA alpha; default 2 × rank.")
    dropout: float = Field(
        0.0, description="LoRA dropout; peft forbids != 0 when experts are targeted."
    )
    targets: list[Target] = Field(
        default_factory=lambda: list(DEFAULT_TARGETS),
        description="Parts that get LoRA: attention, experts, dense, shared, router.",
    )
    expert_mapping: Literal["explicit", "automap"] = Field(
        "explicit",
        description="explicit: target_parameters on fused experts (rank r); "
        "automap: peft's gate/up/down name mapping (doubles gate_up rank, drops dense MLPs).",
    )
    stack: Literal["peft", "mlx"] = Field("peft", description="Training stack the recipe is for.")
    train_router: bool = Field(
        False, description="Train the router (turns on the aux loss); frozen by default."
    )
    mlx_keys: list[str] | None = Field(
        None, description="mlx-lm lora_parameters.keys as written by the user (mlx stack)."
    )

    @field_validator("rank")
    @classmethod
    def _positive_rank(cls, v: int) -> int:
        if v <= 0:
            raise ValueError("rank must be a positive integer (e.g. 8, 16, 64)")
        return v

    @field_validator("dropout")
    @classmethod
    def _dropout_range(cls, v: float) -> float:
        if not 0.0 <= v < 1.0:
            raise ValueError("dropout must be in [0, 1)")
        return v

    @property
    def effective_alpha(self) -> float:
        return self.alpha if self.alpha is not None else 2.0 * self.rank


class TrainArgs(_Section):
    """The training step that the planner traces and the trainer runs."""

    method: Literal["lora", "full", "qlora"] = Field("lora", description="Fine-tuning method.")
    seq_len: int = Field(2048, description="Tokens per sequence.")
    batch_size: int = Field(1, description="Sequences per micro-batch.")
    gradient_checkpointing: bool = Field(True, description="Recompute activations per layer.")
    quantization: Literal["none", "bnb-4bit", "bnb-8bit"] = Field(
        "none", description="Quantisation of the frozen base (bnb leaves fused experts bf16)."
    )
    learning_rate: float = Field(2e-4, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.0, description="AdamW weight decay.")
    lr_scheduler: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Learning-rate schedule after warmup."
    )
    warmup_ratio: float = Field(0.0, description="Fraction of steps spent warming up.")
    epochs: float = Field(1.0, description="Passes over the training data (max_steps wins).")
    max_steps: int | None = Field(None, description="Stop after this many optimizer steps.")
    grad_accum: int = Field(1, description="Micro-batches per optimizer step.")
    seed: int = Field(0, description="Seed for weights init of LoRA, data order and dropout.")
    logging_steps: int = Field(1, description="Log loss and throughput every N steps.")
    save_steps: int = Field(50, description="Atomic checkpoint every N steps (for --resume).")
    routing_every: int = Field(10, description="Routing diagnostics every N steps (0 = off).")
    aux_loss: bool | None = Field(
        None,
        description="Add the router load-balancing loss (output_router_logits). Default: on "
        "only when lora.train_router; recorded either way.",
    )
    aux_loss_coef: float = Field(0.001, description="Coefficient of the aux loss when on.")
    device: Literal["auto", "cpu", "cuda", "mps"] = Field(
        "auto", description="Where to train; auto picks CUDA, then MPS, then CPU."
    )
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="auto: bf16 on GPU, fp32 on CPU."
    )

    @field_validator("seq_len", "batch_size", "grad_accum", "logging_steps", "save_steps")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v <= 0:
            raise ValueError("must be a positive integer")
        return v


class DataArgs(_Section):
    """Training data in TRL's conventions, from local files."""

    train_file: str | None = Field(
        None, description="JSONL/JSON/Parquet with messages, prompt/completion or text rows."
    )
    eval_file: str | None = Field(None, description="Held-out rows in the same format.")
    completion_only_loss: bool = Field(
        True, description="Loss on completions/assistant turns only, where the format allows."
    )
    packing: bool = Field(False, description="Pack short rows into full sequences.")
    overlong: Literal["truncate", "error"] = Field(
        "truncate",
        description="Rows longer than train.seq_len: truncate (counted in data.json) "
        "or error (names the row).",
    )


class OutputArgs(_Section):
    """Where a run writes its adapter, metrics, checkpoints and resolved config."""

    dir: str = Field("runs/latest", description="Run directory (created; never overwritten).")
    ledger: str = Field(
        ".moetune/ledger.jsonl", description="Append-only ledger: one row per attempt."
    )


class HardwareArgs(_Section):
    """Where the run is meant to happen."""

    card: str | None = Field(None, description="Card id from `moetune plan` (e.g. H100-80GB).")


class LaneArgs(_Section):
    """Remote-run infrastructure (the four walls)."""

    provider: Literal["local", "ssh", "runpod"] = Field("local", description="Where to run.")
    volume_gb: int | None = Field(None, description="Pod volume size in GB.")
    watchdog_s: int | None = Field(None, description="In-pod watchdog deadline in seconds.")
    env: dict[str, str] = Field(default_factory=dict, description="Env vars set in the pod.")
    ci_job_timeout_minutes: int | None = Field(None, description="CI job timeout-minutes.")
    ci_step_timeout_minutes: int | None = Field(
        None, description="Step-level timeout-minutes on the launch step."
    )
    estimated_eval_s: int = Field(1800, description="Expected eval time on the pod, seconds.")


class RunConfig(_Section):
    """One run: model, LoRA, data, output, training, hardware and lane."""

    model: ModelArgs = Field(default_factory=ModelArgs)  # type: ignore[arg-type]
    lora: LoraArgs = Field(default_factory=LoraArgs)  # type: ignore[arg-type]
    data: DataArgs = Field(default_factory=DataArgs)  # type: ignore[arg-type]
    output: OutputArgs = Field(default_factory=OutputArgs)  # type: ignore[arg-type]
    train: TrainArgs = Field(default_factory=TrainArgs)  # type: ignore[arg-type]
    hardware: HardwareArgs = Field(default_factory=HardwareArgs)  # type: ignore[arg-type]
    lane: LaneArgs = Field(default_factory=LaneArgs)  # type: ignore[arg-type]


def _apply_override(data: dict[str, Any], assignment: str) -> None:
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise ConfigError(f"bad override {assignment!r}", "write --set section.field=value")
    node = data
    *parents, leaf = key.strip().split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key!r} goes through a non-section", "check the path")
    node[leaf] = yaml.safe_load(raw)


def _describe(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    if first["type"] == "extra_forbidden":
        return f"unknown key {where!r} in run config"
    return f"invalid {where!r}: {first['msg']}"


def parse_config(data: dict[str, Any], overrides: list[str] | None = None) -> RunConfig:
    """Validate a config dict (plus overrides) into a RunConfig, or raise ConfigError."""
    data = copy.deepcopy(data)  # overrides must not leak into the caller's dicts
    for assignment in overrides or []:
        _apply_override(data, assignment)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        fix = "see `moetune schema` for every field and its meaning"
        raise ConfigError(_describe(err), fix) from None


def load_config(path: Path | str, overrides: list[str] | None = None) -> RunConfig:
    """Read a run.yaml; errors name the file and the field."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"run config {path} not found", "pass the path of a run.yaml")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        first = f"{path} is not valid YAML: {err}".splitlines()[0]
        raise ConfigError(first, "fix the YAML syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of sections", "see configs/ for examples")
    try:
        return parse_config(data, overrides)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err.cause}", err.fix) from None


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML (written beside every run's outputs)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def schema_rows() -> list[tuple[str, str, str]]:
    """(field path, default, description) for every field: the documentation of run.yaml."""
    rows = []
    for section, info in RunConfig.model_fields.items():
        model_cls = info.annotation
        for name, field in model_cls.model_fields.items():  # type: ignore[union-attr]
            default = field.get_default(call_default_factory=True)
            rows.append((f"{section}.{name}", repr(default), field.description or ""))
    return rows
