"""Rules for train.nproc > 1 (train/distributed.py): strategies accelerate cannot run here,
refused before any process starts. Split LoRA and quantised experts need no rule: under
FSDP2 and ZeRO-3 they train the 1-process adapter (tests/test_train_distributed.py, gloo)."""

from __future__ import annotations

from importlib import util

import moetune.lint.probes_dist as probes_dist
from moetune.lint.rules import Hit, LintContext, register_rule


def _zero3(ctx: LintContext) -> bool:
    t = ctx.config.train
    return t.nproc > 1 and t.strategy == "zero3"


@register_rule(
    "DIST-SHARDED-CPU",
    "error",
    "ZeRO-3 on CPU processes of a host with a GPU, which accelerate runs as plain DDP",
    probe=probes_dist.fsdp_on_cpu,
    libraries=("accelerate", "torch"),
)
def sharded_cpu(ctx: LintContext) -> Hit | None:
    # fsdp is fine: a CPU rank is switched to accelerate's FSDP2 path (distributed.fsdp_on_cpu);
    # zero3 too on a host without CUDA: its ranks are use_cpu=False over gloo (device_args)
    if not _zero3(ctx) or ctx.config.train.device != "cpu":
        return None
    import torch  # only for a zero3 multi-process run on device cpu

    if not torch.cuda.is_available():
        return None
    return Hit(
        "train.strategy zero3 with train.device cpu beside a GPU: accelerate enters DeepSpeed "
        "only without use_cpu, which would take the GPU, so every CPU rank would hold the "
        "whole model (DDP)",
        "set train.device: auto (ZeRO-3 on the GPUs), or train.strategy: fsdp for CPU ranks",
        "train.device",
    )


@register_rule(
    "DIST-DEEPSPEED-MISSING",
    "error",
    "train.strategy zero3 without the deepspeed package",
    probe=probes_dist.deepspeed_missing,
    libraries=("accelerate",),
)
def deepspeed_missing(ctx: LintContext) -> Hit | None:
    t = ctx.config.train
    if t.nproc == 1 or t.strategy != "zero3" or util.find_spec("deepspeed") is not None:
        return None
    return Hit(
        "train.strategy zero3 needs DeepSpeed, which is not installed: every rank fails at start",
        "pip install 'deepspeed>=0.19.8,<0.20' where moetune runs, or set train.strategy: fsdp",
        "train.strategy",
    )
