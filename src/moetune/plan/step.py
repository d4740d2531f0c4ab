"""The training step the planner sizes: sequence, batch, method, dtypes and engine, read
off a run config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from moetune.config import RunConfig
from moetune.config.keys import splits
from moetune.model.spec import ModelSpec
from moetune.plan.kept import stored_linear_params

Method = Literal["lora", "full", "qlora"]
Optimizer = Literal["fused", "foreach", "for-loop"]
ADAPTER_BYTES = 4  # peft autocast_adapter_dtype=True keeps LoRA weights in fp32
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class Step:
    """The training step being sized."""

    seq_len: int
    batch_size: int = 1
    gradient_checkpointing: bool = True
    method: Method = "lora"
    optimizer: Optimizer = "fused"
    quantization: str = "none"
    weight_bytes: int = 2
    split_lora: bool = False  # lora.engine moetune: expert LoRA on routed tokens, no W+ΔW
    experts_dtype: str = "bf16"  # moetune's frozen expert storage: bf16 | int8 | nf4
    experts_double_quant: bool = False
    # A published quantised base kept as stored (model.quantized_base as_stored): its
    # format (engine/stored/formats.py's quantizer name) and bytes per routed-expert parameter,
    # asked of the format; "" / 0: none.
    stored_experts: str = ""
    stored_bytes: float = 0.0
    # its other quantised Linears (attention, dense and shared MLP), kept as stored too where
    # the format's publishers quantise them (not gpt-oss's MXFP4): bytes per parameter, 0: none
    stored_linear_bytes: float = 0.0
    # how many of those Linears' weights the checkpoint stores quantised: its ignore /
    # exclude lists keep the rest float (plan/kept.py)
    stored_linear_params: int = 0
    fused_head: bool = True  # TRL SFTTrainer's tiled LM head (moetune's trainer) vs full logits

    @property
    def tokens(self) -> int:
        return self.seq_len * self.batch_size

    @property
    def pairs(self) -> int:
        """Query·key pairs per head over the batch (sequences attend within themselves)."""
        return self.batch_size * self.seq_len * self.seq_len

    @property
    def experts_quantised(self) -> bool:
        """The frozen expert stacks are held quantised: int8 / NF4, or as published."""
        return self.experts_dtype != "bf16" or bool(self.stored_bytes)

    @property
    def act_bytes(self) -> int:
        """QLoRA's upcast norms and embeddings carry fp32 hidden states."""
        return 4 if self.method == "qlora" else self.weight_bytes

    @classmethod
    def from_config(cls, cfg: RunConfig, spec: ModelSpec, optimizer: Optimizer = "fused") -> Step:
        quant = cfg.train.quantization
        if cfg.train.tuning == "qlora" and quant == "none":
            quant = "bnb-4bit"
        split = split_lora(spec, cfg)
        return cls(
            seq_len=cfg.train.seq_len,
            batch_size=cfg.train.batch_size,
            gradient_checkpointing=cfg.train.gradient_checkpointing,
            method=cfg.train.tuning,
            optimizer=optimizer,
            quantization=quant,
            weight_bytes=DTYPE_BYTES[cfg.model.dtype],
            split_lora=split,
            experts_dtype=cfg.model.experts_dtype,
            experts_double_quant=cfg.model.experts_double_quant,
            **(_stored(spec, cfg, split and quant == "none") or _published_bnb(spec)),
        )


def split_lora(spec: ModelSpec, cfg: RunConfig) -> bool:
    """Whether the step runs moetune's split-LoRA experts (`lora.engine` resolved on `spec`)."""
    # lazy: heavy to import (torch, peft via moetune.engine)
    from moetune.engine.resolve import resolve_engine

    m = cfg.model
    engine = resolve_engine(spec, cfg.lora, m.experts_dtype, m.quantized_base)
    return cfg.train.tuning != "full" and splits(engine)


def _stored(spec: ModelSpec, cfg: RunConfig, split: bool) -> dict[str, Any]:
    """The stored format's name and bytes when the run keeps the published expert stacks:
    a stored base trains on the split engine; int8 / NF4 asked over one (which train
    refuses) is planned as asked."""
    # lazy: heavy to import (torch via moetune.engine)
    from moetune.engine.resolve import stored_experts

    fmt = stored_experts(spec, cfg.model.quantized_base)
    if fmt is None or not split or cfg.model.experts_dtype != "bf16":
        return {}
    qcfg = spec.quant_config or {}
    per_param = fmt.bytes_per_param(qcfg)
    params = 0 if fmt.experts_only else stored_linear_params(spec, qcfg)
    linears = per_param if params else 0.0
    return {"stored_experts": fmt.name, "stored_bytes": per_param, "stored_linear_bytes": linears,
            "stored_linear_params": params}  # fmt: skip


def bnb_linear_bytes(spec: ModelSpec) -> float:
    """Bytes per parameter of the Linears a bitsandbytes pre-quantised checkpoint stores
    (0: not one). 4-bit: NF4 / FP4 nibbles + an fp32 absmax per 64 (double quant: an int8
    absmax per 64 and an fp32 scale per 256 of those); 8-bit: int8 + an fp32 scale per row.
    transformers' integration quantises nn.Linear only: the fused experts, router, embeddings
    and lm_head stay float (model.dtype)."""
    q = spec.quant_config or {}
    if q.get("quant_method") != "bitsandbytes":
        return 0.0
    if q.get("load_in_8bit"):
        return 1 + 4 / spec.hidden_size
    if q.get("load_in_4bit"):
        return 0.5 + (1 / 64 + 4 / (64 * 256) if q.get("bnb_4bit_use_double_quant") else 4 / 64)
    return 0.0


def _published_bnb(spec: ModelSpec) -> dict[str, Any]:
    """A bitsandbytes pre-quantised base: its attention, dense and shared MLP Linears at the
    bytes it stores them in (frozen_bytes), not as model.dtype."""
    per_param = bnb_linear_bytes(spec)
    if not per_param:
        return {}
    params = stored_linear_params(spec, spec.quant_config or {})  # modules_to_not_convert: float
    return {"stored_linear_bytes": per_param, "stored_linear_params": params}
