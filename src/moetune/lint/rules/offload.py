"""Rules for train.offload cpu | disk (sizing in moetune.plan.offload.memory): a host without the
RAM the plan needs, disk offload without the disk space, offload on a GGUF base."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import moetune.lint.probes.offload as probes_offload
from moetune.config.keys import offload_mode
from moetune.errors import MoetuneError
from moetune.lint.probes import model as probes
from moetune.lint.registry import Hit, LintContext, register_rule
from moetune.plan.devices.ep_offload import plan_offload_of_run
from moetune.units import gib

if TYPE_CHECKING:
    from moetune.plan.offload.memory import OffloadPlan


def _offload_plan(ctx: LintContext) -> OffloadPlan | None:
    """The run's offload plan on hardware.card, or with train.device cpu on this host's RAM;
    None when there is no offload, no known device (no card named for a GPU run), or it
    cannot be planned (plan --offload says why)."""
    cfg = ctx.config
    if not offload_mode(cfg.train.offload).streams or ctx.spec is None or cfg.model.is_gguf:
        return None
    if cfg.hardware.card is None and cfg.train.device != "cpu":
        return None
    try:
        return plan_offload_of_run(ctx.spec, cfg, cfg.hardware.card)  # ep: per rank
    except MoetuneError:
        return None


@register_rule(
    "OFFLOAD-HOST-RAM",
    "error",
    "the host lacks the RAM the offload plan needs",
    probe=probes_offload.host_ram_short,
    libraries=("torch",),
)
def host_ram(ctx: LintContext) -> Hit | None:
    plan = _offload_plan(ctx)
    if plan is None or plan.host_ram_fits:
        return None
    in_ram = offload_mode(plan.offload).in_host_ram
    held = "the offloaded expert stacks" if in_ram else "its staging buffers"
    return Hit(
        f"train.offload {plan.offload} needs {gib(plan.host_ram_bytes)} of host RAM "
        f"({held} and the process), the host has {gib(plan.host_ram_available_bytes)}: the "
        "pages are committed when written, so the run is OOM-killed mid-step, no traceback",
        "set train.offload: disk (it pins two layers' stacks only), use int8 / nf4 experts "
        "(model.experts_dtype), or a host with more RAM (hardware.host_ram_gb says what it has)",
        "train.offload",
    )


def _present(model_id: str) -> bool:
    """The checkpoint already on this disk: a local dir, or a snapshot in the hub cache."""
    if Path(model_id).exists():
        return True
    from huggingface_hub import constants  # lazy: heavy to import

    repo = Path(constants.HF_HUB_CACHE) / f"models--{model_id.replace('/', '--')}"
    return (repo / "snapshots").is_dir()


def _free_bytes(path: str) -> int:
    """Free bytes on the filesystem `path` would be created on."""
    where = Path(path).absolute()
    while not where.exists():
        where = where.parent
    return shutil.disk_usage(where).free


@register_rule(
    "OFFLOAD-DISK-SPACE",
    "error",
    "disk offload without the disk space for the files it streams",
    probe=probes_offload.disk_offload_reads_in_place,
    libraries=("safetensors",),
)
def disk_space(ctx: LintContext) -> Hit | None:
    plan = _offload_plan(ctx)
    if plan is None or not offload_mode(plan.offload).on_disk:
        return None
    cfg = ctx.config
    declared = cfg.hardware.disk_gb
    bf16 = cfg.model.experts_dtype == "bf16"  # else the quantised stacks are written first
    if declared is None and bf16 and _present(cfg.model.id):
        return None  # the safetensors files are already here: they are what streams
    free = int(declared * 1e9) if declared is not None else _free_bytes(cfg.output.dir)
    if plan.disk_bytes <= free:
        return None
    where = "hardware.disk_gb" if declared is not None else f"free at {cfg.output.dir}"
    return Hit(
        f"train.offload disk streams {gib(plan.disk_bytes)} of expert stacks from local "
        f"files, but {where} is {gib(free)}: the files cannot all be there",
        "free disk space (or point output.dir at a larger disk), set train.offload: cpu if "
        "the host RAM holds the stacks, or use int8 / nf4 experts (model.experts_dtype)",
        "train.offload",
    )


@register_rule(
    "OFFLOAD-GGUF",
    "error",
    "offload on a GGUF base, which cannot be trained or streamed",
    probe=probes.gguf_not_trainable,
    libraries=("transformers", "gguf"),
)
def gguf(ctx: LintContext) -> Hit | None:
    cfg = ctx.config
    if not offload_mode(cfg.train.offload).streams or not cfg.model.is_gguf:
        return None
    return Hit(
        f"train.offload {cfg.train.offload} on the GGUF base {cfg.model.id}: transformers only "
        "dequantizes a .gguf (a lossy copy), so there are no safetensors stacks to stream",
        "point model.id at the safetensors checkpoint of the same model (export GGUF after)",
        "model.id",
    )
