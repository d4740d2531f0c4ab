"""The run config's typed sections, grouped by concern; every field documented."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BeforeValidator,
    Field,
    field_validator,
    model_validator,
)

from moetune.config.base import (
    DEFAULT_TARGETS,
    CardMemory,
    DiskSize,
    FiniteFloat,
    Fraction,
    HostRam,
    LoraRank,
    NonNegativeFloat,
    NonNegativeInt,
    Port,
    PositiveFloat,
    PositiveInt,
    Targets,
    _Section,
)
from moetune.config.lane import LaneArgs
from moetune.config.methods import DpoArgs, GrpoArgs


class ModelArgs(_Section):
    """Which base model to fine-tune."""

    id: str = Field(
        "Qwen/Qwen3-30B-A3B",
        description="Local dir/file with config.json, a bundled catalog id, or a hub id.",
    )
    tokenizer: str | None = Field(
        None,
        description="Where the tokenizer comes from when model.id has none: a local dir or a "
        "hub id (default: model.id). Its vocabulary must fit the model's embedding rows.",
    )
    format: Literal["hf", "gguf"] = Field(
        "hf", description="Weight format of the base; gguf bases cannot be trained."
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="Dtype the frozen base weights are held in."
    )
    experts_dtype: Literal["bf16", "int8", "nf4"] = Field(
        "bf16",
        description="Storage of the frozen expert stacks: bf16 (as model.dtype), int8 "
        "(per-channel) or nf4 (blockwise); quantised ones need lora.engine: moetune.",
    )
    experts_double_quant: bool = Field(
        False, description="nf4: quantise the absmax scales too (about 0.4 bits/param less)."
    )
    quantized_base: Literal["as_stored", "dequantize"] = Field(
        "as_stored",
        description="A base published quantised (FP8 / MXFP4 / NVFP4 / INT4 quantization_config): "
        "as_stored keeps every frozen expert stack in the checkpoint's own bytes (lora.engine "
        "moetune); dequantize inflates it to model.dtype at load, as transformers does.",
    )
    trust_remote_code: bool = Field(
        False,
        description="Run the modeling code a checkpoint ships (config.json's auto_map, for a "
        "model_type transformers lacks); it runs as Python with your user's rights.",
    )

    @property
    def is_gguf(self) -> bool:
        """A GGUF base, by declared format or by file name."""
        return self.format == "gguf" or self.id.lower().endswith(".gguf")


class LoraArgs(_Section):
    """The LoRA adapter: where it goes and how big it is."""

    rank: LoraRank = Field(16, description="LoRA rank r (per expert for expert stacks).")
    expert_rank: LoraRank | None = Field(
        None,
        description="Rank of the expert-stack LoRA (per expert) when it should differ from "
        "rank, e.g. 4 to fit a 24 GB card; alpha scales with it (same alpha/r). Needs "
        "expert_mapping explicit.",
    )
    alpha: PositiveFloat | None = Field(None, description="LoRA alpha; default 2 × rank.")
    dropout: float = Field(
        0.0,
        description="LoRA dropout; engine peft forbids != 0 when experts are targeted, engine "
        "moetune applies it to the expert LoRA input.",
    )
    targets: Targets = Field(
        default_factory=lambda: list(DEFAULT_TARGETS),
        description="Parts that get LoRA: attention, experts, dense, shared, router.",
    )
    expert_mapping: Literal["explicit", "automap"] = Field(
        "explicit",
        description="explicit: target_parameters on fused experts (rank r); "
        "automap: peft's gate/up/down name mapping (doubles gate_up rank, drops dense MLPs).",
    )
    stack: Literal["peft", "mlx"] = Field("peft", description="Training stack the recipe is for.")
    engine: Literal["auto", "moetune", "peft"] = Field(
        "auto",
        description="How expert LoRA is computed. moetune: split LoRA (routed tokens only, no "
        "full-size ΔW, expert dropout works; same peft adapter format); peft: ParamWrapper; "
        "auto: moetune where transformers dispatches the family's experts (probed), else peft.",
    )
    train_router: bool = Field(
        False, description="Train the router (turns on the aux loss); frozen by default."
    )
    expert_selection: Literal["all", "gate", "token"] = Field(
        "all",
        description="ESFT-style: train LoRA only on the experts the training data routes to "
        "most, per layer, by mean gate score (gate) or share of routed tokens (token); "
        "all: every expert.",
    )
    expert_selection_share: float = Field(
        0.2,
        description="gate/token selection: per layer, take experts by descending score until "
        "their cumulative share reaches this (ESFT used 0.1–0.2).",
    )
    expert_selection_rows: PositiveInt = Field(
        256, description="gate/token selection: training rows scored with the base model."
    )
    mlx_keys: list[str] | None = Field(
        None, description="mlx-lm lora_parameters.keys as written by the user (mlx stack)."
    )

    @field_validator("expert_selection_share")
    @classmethod
    def _share_range(cls, v: float) -> float:
        if not 0.0 < v <= 1.0:  # NaN fails every comparison, so it is refused too
            raise ValueError("must be a share in (0, 1]")
        return v

    @field_validator("dropout")
    @classmethod
    def _dropout_range(cls, v: float) -> float:
        if not 0.0 <= v < 1.0:
            raise ValueError("must be a probability in [0, 1)")
        return v

    @property
    def effective_alpha(self) -> float:
        return self.alpha if self.alpha is not None else 2.0 * self.rank

    @property
    def effective_expert_rank(self) -> int:
        """The rank expert stacks get: expert_rank, else rank (as effective_alpha is for
        alpha; the one field is `expert_rank`)."""
        return self.expert_rank if self.expert_rank is not None else self.rank

    @property
    def effective_expert_alpha(self) -> float:
        """Expert-stack alpha: the same alpha/r scale as the rest of the adapter."""
        return self.effective_alpha * self.effective_expert_rank / self.rank


Method = Literal["sft", "dpo", "grpo"]
Tuning = Literal["lora", "full", "qlora"]
TUNING_KINDS: tuple[str, ...] = get_args(Tuning)  # the Literal's own values, never a copy


def _moved_method(v: Any) -> Any:
    """An old config's `method: qlora` names the fine-tuning kind, now train.tuning."""
    if v in TUNING_KINDS:
        *others, last = get_args(Method)
        raise ValueError(
            f"must be {', '.join(others)} or {last} – '{v}' is a fine-tuning kind, which moved to "
            f"train.tuning (write `tuning: {v}`)"
        )
    return v


class TrainArgs(_Section):
    """The training step that the planner traces and the trainer runs."""

    method: Annotated[Method, BeforeValidator(_moved_method)] = Field(
        "sft", description="Objective: sft (TRL SFTTrainer), dpo (DPOTrainer), grpo (GRPOTrainer)."
    )
    tuning: Tuning = Field(
        "lora", description="Fine-tuning kind: LoRA, full weights, or QLoRA (bnb 4-bit base)."
    )
    seq_len: PositiveInt = Field(2048, description="Tokens per sequence.")
    batch_size: PositiveInt = Field(1, description="Sequences per micro-batch.")
    gradient_checkpointing: bool = Field(True, description="Recompute activations per layer.")
    quantization: Literal["none", "bnb-4bit", "bnb-8bit"] = Field(
        "none", description="Quantisation of the frozen base (bnb leaves fused experts bf16)."
    )
    learning_rate: PositiveFloat = Field(2e-4, description="Peak AdamW learning rate.")
    weight_decay: NonNegativeFloat = Field(0.0, description="AdamW weight decay.")
    lr_scheduler: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Learning-rate schedule after warmup."
    )
    warmup_ratio: Fraction = Field(0.0, description="Fraction of steps spent warming up.")
    epochs: PositiveFloat = Field(
        1.0, description="Passes over the training data (max_steps wins)."
    )
    max_steps: PositiveInt | None = Field(None, description="Stop after this many optimizer steps.")
    grad_accum: PositiveInt = Field(1, description="Micro-batches per optimizer step.")
    seed: NonNegativeInt = Field(
        0, description="Seed for weights init of LoRA, data order and dropout."
    )
    logging_steps: PositiveInt = Field(1, description="Log loss and throughput every N steps.")
    save_steps: PositiveInt = Field(
        50, description="Atomic checkpoint every N steps (for --resume)."
    )
    routing_every: NonNegativeInt = Field(
        10, description="Routing diagnostics every N steps (0 = off)."
    )
    aux_loss: bool | None = Field(
        None,
        description="Add the router load-balancing loss (output_router_logits). Default: on "
        "only when lora.train_router; recorded either way.",
    )
    aux_loss_coef: NonNegativeFloat = Field(
        0.001, description="Coefficient of the aux loss when on."
    )
    device: Literal["auto", "cpu", "cuda", "mps"] = Field(
        "auto",
        description="Where to train; auto picks CUDA, then MPS, then CPU. cpu trains here on "
        "the CPU on purpose even where hardware.card names a CUDA card (CARD-NOT-HERE refuses "
        "that otherwise).",
    )
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto",
        description="auto: bf16 on GPU (fp16 on a CUDA card without bf16: T4, V100), fp32 on CPU.",
    )
    dpo: DpoArgs = Field(
        default_factory=DpoArgs,  # type: ignore[arg-type]
        description="train.method dpo: its settings.",
    )
    grpo: GrpoArgs = Field(
        default_factory=GrpoArgs,  # type: ignore[arg-type]
        description="train.method grpo: its settings.",
    )
    nproc: PositiveInt = Field(
        1,
        description="Processes (one per GPU) `moetune train` starts through accelerate; "
        "train.batch_size is per process, so the global batch is batch_size × grad_accum × nproc.",
    )
    strategy: Literal["ddp", "fsdp", "zero3", "ep"] = Field(
        "ddp",
        description="How nproc > 1 processes split the work: ddp (every process holds the "
        "model; CPU too, over gloo), fsdp (accelerate FSDP2: each process holds 1/nproc of "
        "weights, grads and optimizer state; GPUs, and CPU over gloo), zero3 (DeepSpeed "
        "ZeRO-3, GPUs only, needs deepspeed) or ep (expert parallelism: each process holds "
        "E/nproc routed experts, tokens travel to them by all-to-all; the rest replicated; "
        "lora.engine moetune; GPUs, and CPU over gloo).",
    )
    ep_degree: PositiveInt | None = Field(
        None,
        description="train.strategy ep: ranks in one expert group (it must divide nproc and "
        "the routed experts). Each group splits the experts E/ep_degree a rank and exchanges "
        "tokens within itself; the nproc/ep_degree groups hold the same experts, and every "
        "other weight and all the LoRA are FSDP2-sharded over all ranks (a 2-D DeviceMesh). "
        "Unset: one group of all ranks, the rest replicated under DDP.",
    )
    ep_placement: Literal["contiguous", "balanced"] = Field(
        "contiguous",
        description="train.strategy ep: which experts a rank holds. contiguous: experts "
        "i*E/N to (i+1)*E/N - 1 on rank i; balanced: each layer's experts bin-packed by the "
        "base's routing, measured on training rows before the first step (needs "
        "train.routing_every > 0), so each rank receives about the same rows. The adapter is "
        "saved in the base's expert order.",
    )
    offload: Literal["none", "cpu", "disk"] = Field(
        "none",
        description="Where the frozen expert stacks wait between uses: none (on the device), "
        "cpu (host RAM, pinned on CUDA) or disk (the base's safetensors files, read by offset); "
        "they reach the device a layer at a time, prefetched one layer ahead. LoRA factors, "
        "their gradients and optimizer state stay on the device (needs lora.engine moetune).",
    )
    nnodes: PositiveInt = Field(
        1, description="Nodes in a multi-node run (train.nproc processes on each)."
    )
    node_rank: NonNegativeInt = Field(
        0, description="This node's rank in a multi-node run (0 writes the run dir and ledger)."
    )
    master_addr: str | None = Field(
        None, description="Address of node 0 in a multi-node run (required when nnodes > 1)."
    )
    master_port: Port = Field(29500, description="Port node 0 listens on in a multi-node run.")
    rdzv_timeout_s: PositiveInt = Field(
        600,
        description="Multi-node start: seconds a node waits for the others (node K > 0 for "
        "node 0 to listen at master_addr:master_port, node 0 for every node to join – "
        "torchrun's rendezvous timeout) before it gives up with a line naming who it awaited.",
    )


SourceFormat = Literal[
    "auto", "messages", "sharegpt", "alpaca", "prompt_completion", "text", "preference"
]


MAX_WEIGHT = 1000  # data.sources[].weight: repeats of a source per epoch, past which it is a typo


class SourceArgs(_Section):
    """One dataset of the training mix: a hub id, a local directory or a file."""

    path: str = Field(
        description="Hub dataset id (owner/name), a local dir (data files, or a dataset saved "
        "with save_to_disk) or a file (.jsonl .json .parquet .csv .arrow)."
    )
    name: str | None = Field(None, description="The dataset's configuration (subset) name.")
    split: str = Field("train", description="The split to read (e.g. train_sft).")
    weight: float = Field(
        1.0,
        description="Rows per epoch as a multiple of the source's rows: 2 repeats each row "
        "twice, 0.5 keeps a seeded half (streaming: the share of rows drawn from it); "
        "0 < weight <= 1000.",
    )
    format: SourceFormat = Field(
        "auto",
        description="Row format: auto (by keys), messages, sharegpt (conversations/from/value), "
        "alpaca (instruction/input/output), prompt_completion, text, preference.",
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="Keys this source names differently, {format key: source column} "
        "(e.g. {prompt: question, completion: answer}).",
    )
    max_rows: PositiveInt | None = Field(None, description="Read only the first N rows.")

    @model_validator(mode="after")
    def _weight_positive(self) -> SourceArgs:
        if not self.weight > 0:  # also refuses NaN
            raise ValueError(
                f"weight must be > 0 for source {self.path!r}, got {self.weight} "
                "(leave a source out instead of giving it weight 0)"
            )
        if not self.weight <= MAX_WEIGHT:  # inf, or a repeat count no epoch could hold
            raise ValueError(
                f"weight must be at most {MAX_WEIGHT} for source {self.path!r}, got "
                f"{self.weight} (raise train.epochs to see every row more often)"
            )
        return self


class DataArgs(_Section):
    """Training data: one file (train_file) or a weighted mix of sources, in TRL's row
    conventions after conversion."""

    train_file: str | None = Field(
        None,
        description="One source: a file or dir of messages, prompt/completion, text, "
        "sharegpt, alpaca or preference rows (shorthand for sources: [{path: ...}]).",
    )
    eval_file: str | None = Field(None, description="Held-out rows in the same format.")
    sources: list[SourceArgs] = Field(
        default_factory=list,
        description="Datasets to mix: [{path, name, split, weight, format, columns, max_rows}].",
    )
    eval_sources: list[SourceArgs] = Field(
        default_factory=list, description="Held-out datasets (instead of data.eval_file)."
    )
    eval_fraction: float = Field(
        0.0,
        ge=0.0,
        lt=0.5,
        description="With no eval source, hold out this share of rows, chosen by a hash of "
        "each row (the same rows whatever the order, seed or rank).",
    )
    streaming: bool = Field(
        False,
        description="Read sources lazily (sets larger than RAM); needs train.max_steps; only "
        "the first rows are checked before training.",
    )
    chat_template: str | None = Field(
        None,
        description="Override the tokenizer's chat template: a .jinja file, or a template "
        "TRL ships by name (e.g. qwen3, llama3).",
    )
    completion_only_loss: bool = Field(
        True, description="Loss on completions/assistant turns only, where the format allows."
    )
    packing: bool = Field(False, description="Pack short rows into full sequences.")
    overlong: Literal["truncate", "error"] = Field(
        "truncate",
        description="Rows longer than train.seq_len: truncate (counted in data.json; a row "
        "far past it is cut by characters before it is tokenised) or error (names the row).",
    )

    @model_validator(mode="after")
    def _one_way_each(self) -> DataArgs:
        if self.train_file and self.sources:
            raise ValueError("set data.train_file or data.sources, not both")
        if self.eval_file and self.eval_sources:
            raise ValueError("set data.eval_file or data.eval_sources, not both")
        if self.eval_fraction and (self.eval_file or self.eval_sources):
            raise ValueError("data.eval_fraction carves eval rows only when no eval source is set")
        return self

    def train_sources(self) -> list[SourceArgs]:
        """data.sources, or train_file as the one source."""
        return self.sources or _one_source(self.train_file)

    def held_out_sources(self) -> list[SourceArgs]:
        """data.eval_sources, or eval_file as the one source."""
        return self.eval_sources or _one_source(self.eval_file)


def _one_source(path: str | None) -> list[SourceArgs]:
    return [SourceArgs.model_validate({"path": path})] if path else []


class OutputArgs(_Section):
    """Where a run writes its adapter, metrics, checkpoints and resolved config."""

    dir: str = Field("runs/latest", description="Run directory (created; never overwritten).")
    ledger: str = Field(
        ".moetune/ledger.jsonl", description="Append-only ledger: one row per attempt."
    )
    serve_with: list[Literal["vllm", "llama.cpp", "peft"]] = Field(
        default_factory=list,
        description="Stacks the adapter will be served with (lint warns about their traps; "
        "`moetune export` writes for them): vllm, llama.cpp, peft (unmerged).",
    )
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = Field(
        default_factory=list,
        description="Trackers the run logs to through transformers' own integrations, "
        "moetune's MoE metrics included; their files go under output.dir unless their own "
        "environment variables say otherwise (`pip install 'moetune[trackers]'`).",
    )

    @field_validator("report_to")
    @classmethod
    def _each_tracker_once(cls, value: list[str]) -> list[str]:
        twice = sorted({t for t in value if value.count(t) > 1})
        if twice:  # transformers would start that tracker twice: two event files, one run
            raise ValueError(f"names {', '.join(twice)} twice; list each tracker once")
        return value


class HardwareArgs(_Section):
    """Where the run is meant to happen."""

    card: str | None = Field(
        None,
        description="Card id from `moetune plan` (e.g. H100-80GB), or an unlisted card by its "
        "memory (e.g. 24GB: planned by memory alone, no time or cost estimate).",
    )
    card_memory_gb: CardMemory | None = Field(
        None,
        description="An unlisted card by its memory in GB (as marketed): the same as "
        "hardware.card: <N>GB, which it sets.",
    )
    host_ram_gb: HostRam | None = Field(
        None,
        description="Host RAM per node in GB, for the offload and sharded-load plans "
        "(default: this machine's when planning locally, the card's typical host otherwise).",
    )
    disk_gb: DiskSize | None = Field(
        None, description="Free disk per node in GB for train.offload: disk (default: measured)."
    )

    @model_validator(mode="before")
    @classmethod
    def _card_by_memory(cls, data: Any) -> Any:
        """card_memory_gb names the card `<N>GB` (plan.hardware.card_by_memory); a card
        named apart from it is a contradiction, refused."""
        if not isinstance(data, dict) or data.get("card_memory_gb") is None:
            return data
        try:
            by_memory = f"{float(data['card_memory_gb']):g}GB"
        except (TypeError, ValueError):
            return data  # the field's own validation says why
        if data.get("card") not in (None, by_memory):
            raise ValueError(
                f"hardware.card {data['card']!r} and hardware.card_memory_gb "
                f"{data['card_memory_gb']} both name the card: keep one"
            )
        return {**data, "card": by_memory}


RungRole = Literal["target", "protected"]


class RungArgs(_Section):
    """One rung of the eval ladder: a dataset, how it is scored, and what it must show."""

    name: str = Field(description="Unique rung name (a file name: letters, digits, - _ .).")
    kind: str = Field(
        description="Registered rung kind: loss, exact_match, contains, multiple_choice, lm_eval."
    )
    role: RungRole = Field(
        "protected",
        description="target: must improve by min_gain; protected: must not regress by margin.",
    )
    data: str | None = Field(
        None, description="JSONL file of items (lm_eval: unused; the task YAML names its data)."
    )
    margin: NonNegativeFloat = Field(
        0.1,
        description="Protected: largest tolerated drop of the score (non-inferiority margin), "
        "in the rung's units (accuracy, or nats per token for loss).",
    )
    floor: FiniteFloat | None = Field(
        None, description="Protected: absolute floor the candidate's score must reach."
    )
    min_gain: NonNegativeFloat = Field(
        0.05, description="Target: the gain the lower confidence bound must reach."
    )
    max_new_tokens: PositiveInt | None = Field(
        None,
        description="exact_match: generation limit; default the answer's length + its end "
        "(EOS, or the chat turn's end), so a model that does not stop is wrong. contains: "
        "default 64.",
    )
    task: str | None = Field(None, description="lm_eval: task name.")
    include_path: str | None = Field(None, description="lm_eval: folder of local task YAMLs.")
    metric: str = Field("acc", description="lm_eval: metric to gate on (e.g. acc, exact_match).")

    @field_validator("name")
    @classmethod
    def _file_name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", v):
            raise ValueError("rung names are file names: letters, digits, '-', '_' and '.'")
        return v


class GateArgs(_Section):
    """How the promotion gate decides from paired base-vs-candidate differences."""

    alpha: float = Field(
        0.05,
        description="Family-wise error rate across rungs (Holm); sets z of each rung's bound.",
    )

    @field_validator("alpha")
    @classmethod
    def _alpha_range(cls, v: float) -> float:
        if not 0.0 < v < 0.5:
            raise ValueError("must be in (0, 0.5)")
        return v


class EvalArgs(_Section):
    """The eval ladder run by `moetune eval` and judged by `moetune gate`."""

    rungs: list[RungArgs] = Field(default_factory=list, description="The ladder, in order.")
    gate: GateArgs = Field(
        default_factory=GateArgs,  # type: ignore[arg-type]
        description="Decision settings of the promotion gate.",
    )
    batch_size: PositiveInt = Field(32, description="Items scored per forward pass.")
    limit: PositiveInt | None = Field(
        None, description="Score only the first N items of each rung."
    )
    results_dir: str | None = Field(
        None, description="Where results go; default <output.dir>/eval."
    )

    @field_validator("rungs")
    @classmethod
    def _unique_names(cls, v: list[RungArgs]) -> list[RungArgs]:
        names = [r.name for r in v]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"rung names must be unique; repeated: {', '.join(dupes)}")
        return v

    def results_path(self, output_dir: str) -> Path:
        return Path(self.results_dir) if self.results_dir else Path(output_dir) / "eval"


class RunConfig(_Section):
    """One run: model, LoRA, data, output, training, hardware, lane and eval ladder."""

    model: ModelArgs = Field(default_factory=ModelArgs)  # type: ignore[arg-type]
    lora: LoraArgs = Field(default_factory=LoraArgs)  # type: ignore[arg-type]
    data: DataArgs = Field(default_factory=DataArgs)  # type: ignore[arg-type]
    output: OutputArgs = Field(default_factory=OutputArgs)  # type: ignore[arg-type]
    train: TrainArgs = Field(default_factory=TrainArgs)  # type: ignore[arg-type]
    hardware: HardwareArgs = Field(default_factory=HardwareArgs)  # type: ignore[arg-type]
    lane: LaneArgs = Field(default_factory=LaneArgs)  # type: ignore[arg-type]
    eval: EvalArgs = Field(default_factory=EvalArgs)  # type: ignore[arg-type]
