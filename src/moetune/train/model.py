"""The model a run trains: the base loaded as the engine needs it (quantised experts
while loading, where asked), wrapped with the recipe's LoRA, audited, and refused when a
requested target got none."""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from moetune.config import RunConfig
from moetune.config.keys import offload_mode, splits
from moetune.io import atomic_write_json
from moetune.model.derive import checkpoint_class, ensure_backbone
from moetune.model.families.registry import get_family
from moetune.model.fixes.registry import apply_fixes
from moetune.model.layers import decoder_layers
from moetune.recipe.audit import audit_coverage
from moetune.recipe.targets import build_peft_config, peft_notes
from moetune.train.callbacks import quiet
from moetune.train.distributed import sharded_load
from moetune.train.distributed.ep_generate import sync_generation
from moetune.train.errors import TrainError
from moetune.train.rundir.checkpoint import RunDir
from moetune.train.setup import Placement, Setup

if TYPE_CHECKING:
    from torch import nn

    from moetune.model.spec import ModelSpec
    from moetune.recipe.audit import CoverageReport

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


_QUANT_REPORT = "_moetune_quant_report"  # on a model loaded with quantised experts
REPLAY = "_moetune_recompute_replay"  # on an ep model checkpointed: its RecomputeReplay


def load_model(
    cfg: RunConfig, place: Placement, engine: str, stored: str | None, load_dtype: str
) -> nn.Module:
    """The base as `engine` (the resolved lora.engine) trains it, in `load_dtype`
    (Placement.load_dtype); `stored`: the format of a base published quantised."""
    # lazy: heavy to import (transformers)
    from transformers import AutoConfig

    dtype = _DTYPES[load_dtype]
    if offload_mode(cfg.train.offload).streams:  # expert stacks to host RAM or left in the files
        # lazy: heavy to import (moetune)
        from moetune.train.offload import load_offloaded_model

        scratch = Path(cfg.output.dir) / ".staging" / "offload"  # cleared with the staging dir
        return load_offloaded_model(
            cfg, place, dtype, _model_dir(cfg.model.id), scratch, stored is not None, _ep_rank(cfg)
        )
    ep = _ep_rank(cfg)
    if ep is not None:  # expert parallelism: this rank's experts' bytes only, any dtype
        return _load_partitioned(cfg, dtype, engine, stored is not None, *ep)
    if stored is not None:  # published FP8 / FP4: read as stored
        return load_stored_model(cfg, place, dtype, engine)
    if cfg.model.experts_dtype != "bf16":
        return load_quantized_model(cfg, place, dtype, engine)
    if not sharded_load.loads_weights():  # its shard comes from rank 0 in prepare()
        return sharded_load.note_loaded(sharded_load.meta_base(cfg.model.id, dtype))
    try:
        with quiet():
            cls: Any = checkpoint_class(AutoConfig.from_pretrained(cfg.model.id))  # own layout
            loaded: Any = cls.from_pretrained(cfg.model.id, dtype=dtype, output_loading_info=True)
            model, info = loaded
            ensure_backbone(model)
            apply_fixes(model)  # transformers bugs in its type's class (Llama 4, Qwen3-Omni, Step)
    except OSError as exc:
        raise TrainError(
            f"cannot load the weights of {cfg.model.id}: {str(exc).splitlines()[0]}",
            "point model.id at a directory with config.json and weights, or a hub id",
        ) from None
    except RuntimeError as exc:  # transformers: "size mismatch" / "ignore_mismatched_sizes"
        if "mismatch" not in str(exc):
            raise
        raise weights_mismatch(cfg.model.id, "tensor shapes differ from what it builds") from None
    if info["missing_keys"]:  # transformers would train on randomly initialised layers
        first = sorted(info["missing_keys"])[0]
        missing = f"{len(info['missing_keys'])} tensors it builds are not in the weights ({first})"
        raise weights_mismatch(cfg.model.id, missing)
    return sharded_load.note_loaded(cast("nn.Module", model))


def _ep_rank(cfg: RunConfig) -> tuple[int, int] | None:
    """(this rank, ranks) of a `train.strategy ep` launch of 2+ processes (its environment)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.train.strategy != "ep" or world == 1:
        return None
    group = cfg.train.ep_degree or world  # ranks r, r+1, … of one group (ep_mesh.py's layout)
    return int(os.environ.get("RANK", "0")) % group, group


def _load_partitioned(
    cfg: RunConfig, dtype: torch.dtype, engine: str, stored: bool, rank: int, ranks: int
) -> nn.Module:
    """The base with only this rank's routed experts read (engine/ep_load.py) – float,
    quantised to model.experts_dtype, or as stored – on the host as from_pretrained leaves
    it; shard_experts swaps them in after the LoRA wrap."""
    # lazy: heavy to import (moetune's engine pulls transformers)
    from moetune.engine import IMPLEMENTATION, ep_load, register
    from moetune.engine.quant.stacks import require_split_engine

    m, where = cfg.model, (_model_dir(cfg.model.id), "cpu", dtype, rank, ranks)
    report: Any = None
    with quiet():
        if stored:
            keep, inflate = m.quantized_base == "as_stored", m.quantized_base == "dequantize"
            model, report = ep_load.load_partitioned_stored(*where, keep, inflate)
        elif m.experts_dtype != "bf16":
            require_split_engine(engine, m.experts_dtype)  # also under --allow-errors
            model, report = ep_load.load_partitioned_quantized(
                *where, m.experts_dtype, m.experts_double_quant
            )
        else:
            model = ep_load.load_partitioned(*where)
    apply_fixes(model)
    if report is not None and not (stored and m.quantized_base == "dequantize"):
        register()  # every quantised stack, LoRA or not, goes one expert at a time
        model.set_experts_implementation(IMPLEMENTATION)
        model.__dict__[_QUANT_REPORT] = report
    return sharded_load.note_loaded(cast("nn.Module", model))


def weights_mismatch(model_id: str, what: str) -> TrainError:
    return TrainError(
        f"config.json of {model_id} does not match its weights: {what}",
        "use the config.json that was saved with these weights (or the weights it describes)",
    )


def load_quantized_model(
    cfg: RunConfig, place: Placement, dtype: torch.dtype, engine: str
) -> nn.Module:
    """The base with its expert stacks quantised while loading; its QuantReport rides along."""
    # lazy: heavy to import (moetune)
    from moetune.engine import IMPLEMENTATION, register
    from moetune.engine.quant.stacks import require_split_engine, shardable_

    require_split_engine(engine, cfg.model.experts_dtype)  # also under --allow-errors
    model = _quantized_base(cfg, place, dtype)
    apply_fixes(model)
    register()  # every quantised stack, LoRA or not, goes one expert at a time
    model.set_experts_implementation(IMPLEMENTATION)
    if sharded_load.active():  # FSDP shards Parameters only: the stacks become frozen ones
        shardable_(model)
    return sharded_load.note_loaded(cast("nn.Module", model))


def _quantized_base(cfg: RunConfig, place: Placement, dtype: torch.dtype) -> Any:
    """Streamed and quantised (its QuantReport rides along); on a sharded load's other
    ranks, the same quantised stacks on meta – their shards come from rank 0 in prepare()."""
    # lazy: heavy to import (moetune)
    from moetune.engine.quant.load import load_quantized

    m = cfg.model
    if not sharded_load.loads_weights():
        return sharded_load.meta_quantized(m.id, m.experts_dtype, dtype, m.experts_double_quant)
    device = "cpu" if sharded_load.active() else place.device  # rank 0: whole, on the host
    with quiet():
        model, report = load_quantized(_model_dir(m.id), m.experts_dtype, device, dtype,
                                       double_quant=m.experts_double_quant)  # fmt: skip
    model.__dict__[_QUANT_REPORT] = report
    return model


def load_stored_model(
    cfg: RunConfig, place: Placement, dtype: torch.dtype, engine: str
) -> nn.Module:
    """A published quantised base: expert stacks as stored, trained one expert at a time by
    the split engine; or (model.quantized_base: dequantize) inflated to model.dtype at load."""
    # lazy: heavy to import (moetune)
    from moetune.engine import IMPLEMENTATION, register
    from moetune.engine.stored.load import dequantize_stacks_, load_stored

    with quiet():
        as_stored = cfg.model.quantized_base == "as_stored"  # every stored Linear kept so too
        model, report = load_stored(_model_dir(cfg.model.id), place.device, dtype, as_stored)
    apply_fixes(model)
    if cfg.model.quantized_base == "dequantize":
        dequantize_stacks_(model)
        return sharded_load.note_loaded(model)
    register()  # every stored stack, LoRA or not, goes one expert at a time
    model.set_experts_implementation(IMPLEMENTATION)
    model.__dict__[_QUANT_REPORT] = report
    return model


def _model_dir(model_id: str) -> str:
    """A local checkpoint dir: the id itself, or its hub snapshot (cached when offline)."""
    if os.path.isdir(model_id):
        return model_id
    # lazy: heavy to import (huggingface_hub)
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model_id, allow_patterns=["*.json", "*.safetensors"])
    except Exception as exc:  # hub errors have no common base beyond OSError/ValueError
        raise TrainError(
            f"cannot fetch the weights of {model_id}: {str(exc).splitlines()[0]}",
            "point model.id at a directory with config.json and *.safetensors",
        ) from None


def _split_and_dropout(wrapped: nn.Module, cfg: RunConfig, engine: str, built: float) -> None:
    """moetune's engine: split expert LoRA with its dropout, and the dropout peft's config
    could not carry (ParamWrapper refuses it) on every other LoRA layer."""
    # lazy: heavy to import (moetune)
    from moetune.engine import apply_lora_dropout, apply_split_lora

    if splits(engine) and "experts" in cfg.lora.targets:
        apply_split_lora(wrapped, dropout=cfg.lora.dropout)  # same peft params, split forward
    if cfg.lora.dropout != built:
        apply_lora_dropout(wrapped, cfg.lora.dropout)


def wrap_lora(
    model: nn.Module, cfg: RunConfig, run: RunDir, setup: Setup
) -> tuple[nn.Module, CoverageReport]:
    """Apply the recipe's LoRA (seeded), audit it into coverage.json, refuse any gap."""
    quant = model.__dict__.get(_QUANT_REPORT)
    wrapped, report, notes, built = peft_wrapped(model, cfg, setup.spec)
    if setup.args.should_save:
        atomic_write_json(run.coverage, {**report.to_json(), "peft_warnings": notes})
        if quant is not None:
            atomic_write_json(run.root / "quant.json", quant.to_json())
    finish_lora(wrapped, report, cfg, setup.engine, built)
    _place_experts(wrapped, cfg, setup)
    return wrapped, report


def peft_wrapped(
    model: nn.Module, cfg: RunConfig, spec: ModelSpec
) -> tuple[nn.Module, CoverageReport, list[str], float]:
    """The recipe's LoRA on `model` (seeded by train.seed) and its coverage audit: (the peft
    model, the audit, peft's warnings, the dropout peft's config carries)."""
    from peft import get_peft_model
    from transformers import set_seed

    from moetune.engine.forwards import apply_overrides
    from moetune.engine.offload.store import peft_targets  # quantised and offloaded stacks

    set_seed(cfg.train.seed)  # the LoRA A matrices are initialised here
    # given the model: a multimodal checkpoint's class gets LoRA on its language model only
    config = build_peft_config(spec, cfg.lora, model)
    with warnings.catch_warnings(record=True) as caught, peft_targets(model):
        warnings.simplefilter("always")
        # a fresh config each time: get_peft_model rewrites the one it is given;
        # peft_targets: peft only sees quantised stacks as stand-in Parameters
        wrapped = get_peft_model(model, copy.deepcopy(config))
    sharded_load.materialise_trainable(wrapped)  # a meta rank's LoRA: real, distinct storage
    apply_overrides(wrapped)  # families whose experts peft's wrappers cannot reach (dbrx)
    notes = peft_notes(caught, config)
    return wrapped, audit_coverage(wrapped, spec, cfg.lora), notes, config.lora_dropout


def finish_lora(
    wrapped: nn.Module, report: CoverageReport, cfg: RunConfig, engine: str, built: float
) -> None:
    """Refuse a coverage gap (or an unrequested router), then moetune's split forward and
    dropout – only on an audited model."""
    require_full_coverage(report)
    _split_and_dropout(wrapped, cfg, engine, built)


def _place_experts(wrapped: nn.Module, cfg: RunConfig, setup: Setup) -> None:
    """train.strategy ep on several ranks: this rank keeps its own routed experts and their
    LoRA only (engine/ep_lora.py), and the experts exchange tokens (expert_parallel.py).
    Checkpointed, the recompute replays each forward's routing (train/distributed/
    ep_replay.py) – on one process too, so a one-process ep run is the same computation as
    N ranks."""
    if cfg.train.strategy != "ep":
        return
    if cfg.train.gradient_checkpointing:
        replay_routing_in_recompute(wrapped, setup.spec)
    if setup.args.world_size == 1:
        return
    # lazy: heavy to import (torch.distributed's DeviceMesh)
    from moetune.engine.ep_lora import shard_lora
    from moetune.engine.expert_parallel import ep_mesh, shard_experts

    device = next(iter(wrapped.parameters())).device.type
    sync_generation(wrapped)  # GRPO's rollouts: every rank runs every decoding step
    if cfg.train.ep_degree is not None:  # expert groups, the rest FSDP2-sharded
        _place_experts_fsdp(wrapped, cfg.train.ep_degree, device, setup.spec)
        return
    shard_experts(wrapped, ep_mesh(device))
    shard_lora(wrapped)  # only its experts' LoRA factors (balanced moves them with the experts)


def _place_experts_fsdp(wrapped: nn.Module, degree: int, device: str, spec: ModelSpec) -> None:
    """train.ep_degree: experts split within groups of `degree` ranks on a 2-D mesh, every
    other weight and all the LoRA FSDP2-sharded over it (train/distributed/ep_mesh.py)."""
    # lazy: heavy to import (FSDP2, DTensor, transformers)
    from moetune.engine.expert_parallel import shard_experts
    from moetune.train.distributed.ep_mesh import ep_fsdp_mesh, shard_rest

    mesh = ep_fsdp_mesh(device, degree)
    shard_experts(wrapped, mesh["ep"])
    shard_rest(wrapped, mesh, decoder_layers(wrapped, spec, get_family(spec.model_type)))


def replay_routing_in_recompute(wrapped: nn.Module, spec: ModelSpec) -> None:
    """Every MoE router keeps its forward's top-k for the checkpointed recompute."""
    # lazy: heavy to import (moetune's routing recorder pulls the model families)
    from moetune.train.distributed.ep_replay import RecomputeReplay
    from moetune.train.routing.recorder import router_modules

    routers = router_modules(wrapped, spec).values()
    wrapped.__dict__[REPLAY] = RecomputeReplay(routers, spec.num_experts, spec.top_k)


def require_full_coverage(report: CoverageReport) -> None:
    """Every requested target adapted, and the router untouched unless it was requested."""
    unrequested_router = report.router_adapted and "router" not in report.kinds
    if report.expected and report.coverage == 1.0 and not unrequested_router:
        return
    if unrequested_router:
        cause = "the router got LoRA/training although lora.train_router is off"
    else:
        cause = (
            f"only {report.adapted}/{report.expected} requested LoRA targets are adapted "
            f"({report.coverage:.0%}); missed: {report.missed_summary() or 'everything'}"
        )
    raise TrainError(
        f"{report.model}: {cause}; nothing was trained (see coverage.json)",
        "use lora.expert_mapping: explicit, or report the model if it still misses targets",
    )
