"""A base published quantised (FP8 / MXFP4 / NVFP4 / INT4) in a run: refused up front where it
cannot work – every key and shape checked from the files' headers before a weight is read."""

from __future__ import annotations

import os

import torch

from moetune.config import RunConfig
from moetune.config.keys import offload_mode, splits
from moetune.model import load_spec
from moetune.model.spec import ModelSpec
from moetune.model.weight_files import checkpoint_files
from moetune.plan.step import bnb_linear_bytes
from moetune.train.errors import TrainError


def stored_base(cfg: RunConfig, spec: ModelSpec) -> str | None:
    """The stored format of a base published quantised, read off its spec (config.json's
    quantization_config, the one source the plan reads too) – or None for a float one."""
    if cfg.model.is_gguf:
        return None
    # lazy: heavy to import (moetune.engine)
    from moetune.engine.stored.formats import stored_format

    found = stored_format(spec.quant_config)
    return None if found is None else found.name


def own_reader(cfg: RunConfig, spec: ModelSpec) -> bool:
    """Whether moetune's loaders read the base's files (checkpoint_files: a stored, quantised or
    offloaded base) rather than transformers' from_pretrained (train/model.py's dispatch)."""
    quantised = cfg.model.experts_dtype != "bf16" or stored_base(cfg, spec) is not None
    return quantised or offload_mode(cfg.train.offload).streams


def check_stored(cfg: RunConfig, spec: ModelSpec, engine: str) -> str | None:
    """Refuse what a stored base cannot do; its format's name (Setup.stored: the loaders
    take it from there), or None for a float base."""
    fmt = stored_base(cfg, spec)  # one moetune cannot read: QuantError, naming the readable
    if fmt is None:
        check_bnb_base(cfg, spec)
        return None
    as_stored = cfg.model.quantized_base == "as_stored"
    fix = "or set model.quantized_base: dequantize (inflates the experts to model.dtype)"
    if cfg.model.experts_dtype != "bf16":
        raise TrainError(
            f"the base is already stored as {fmt}; model.experts_dtype "
            f"{cfg.model.experts_dtype} would quantise it a second time",
            "set model.experts_dtype: bf16 (the stored bytes are kept as they are)",
        )
    if as_stored and not splits(engine):
        raise TrainError(
            f"the base's experts are stored as {fmt}; peft's experts path cannot wrap stored "
            "stacks (it re-materialises every float stack)",
            f"set lora.engine: auto or moetune (lora.targets with experts), {fix}",
        )
    several = cfg.train.nproc > 1 or cfg.train.nnodes > 1
    if as_stored and several and cfg.train.strategy != "ep":
        raise TrainError(f"a base kept as stored ({fmt}) trains on several processes with "
                         f"expert parallelism only (train.strategy {cfg.train.strategy})",
                         "set train.strategy: ep (--strategy ep: each rank holds its own "
                         "experts as stored), or train.nproc: 1 and train.nnodes: 1, "
                         f"{fix}")  # fmt: skip
    if not as_stored and offload_mode(cfg.train.offload).streams:
        raise TrainError("train.offload streams the stored bytes of a quantised base",
                         "set model.quantized_base: as_stored, or train.offload: none")  # fmt: skip
    # lazy: heavy to import (moetune.engine, transformers)
    from moetune.engine.stored.load import open_stored

    if os.path.isdir(cfg.model.id):  # a hub base is checked once its files are here
        open_stored(cfg.model.id, torch.float32)  # every stack's keys and shapes, from headers
    return fmt


def check_stored_before_launch(cfg: RunConfig) -> None:
    """check_stored in the launcher of a several-rank run, before any rank starts: each rank
    would otherwise refuse it inside, after the launcher's own trace."""
    # lazy: heavy to import (moetune.engine)
    from moetune.engine.resolve import resolve_engine

    spec = load_spec(cfg.model.id, cfg.model.trust_remote_code)
    base = cfg.model
    check_stored(cfg, spec, resolve_engine(spec, cfg.lora, base.experts_dtype, base.quantized_base))


def check_bnb_base(cfg: RunConfig, spec: ModelSpec) -> None:
    """Refuse what a bitsandbytes pre-quantised base cannot do: train.offload (its loaders
    build the float model and would read the packed bytes as weights), and routed experts
    stored quantised one Linear each (as transformers 4 saved MoE bases): transformers 5
    builds fused expert stacks, which its bitsandbytes integration does not quantise."""
    if not bnb_linear_bytes(spec):
        return
    if cfg.train.offload != "none":
        raise TrainError("train.offload does not read a bitsandbytes pre-quantised base",
                         "set train.offload: none (the base's Linears are already 4 / 8-bit), "
                         "or train its bf16 release")  # fmt: skip
    if os.path.isdir(cfg.model.id):
        _bnb_experts(cfg.model.id)


def _bnb_experts(model_id: str) -> None:
    """check_bnb_base's per-expert refusal, from the files' headers (no weight read)."""
    # lazy: heavy to import (moetune.engine, torch)
    from moetune.engine.stack_files import read_header

    files = checkpoint_files(model_id)
    keys = (k for f in files for k in read_header(f))
    found = next((k for k in keys if ".experts." in k and k.endswith(QUANT_STATE_KEYS)), None)
    if found is not None:
        raise TrainError(
            f"the base stores its routed experts bitsandbytes-quantised one Linear each "
            f"({found}), as transformers 4 saved MoE bases; transformers 5 builds fused "
            "expert stacks that bitsandbytes does not hold",
            "use the base's bf16 release (model.experts_dtype: nf4 keeps its experts 4-bit), "
            "or one saved with transformers >= 5",
        )


# what bitsandbytes saves beside a quantised Linear's weight (4-bit absmax, 8-bit row scales)
QUANT_STATE_KEYS = (".weight.absmax", ".SCB")
