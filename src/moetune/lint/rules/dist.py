"""Rules for train.nproc > 1 (train/launch.py): strategies accelerate cannot run here,
refused before any process starts. Split LoRA and quantised experts need no rule: under
FSDP2 and ZeRO-3 they train the 1-process adapter (tests/test_train_distributed.py, gloo)."""

from __future__ import annotations

import ipaddress
from importlib import util

import moetune.lint.probes.dist as probes_dist
from moetune.lint.registry import Hit, LintContext, register_rule


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


def is_loopback(addr: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: node 0 as seen from node 0 only."""
    if addr.strip().lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(addr.strip()).is_loopback
    except ValueError:
        return False  # a host name: each node resolves it


def malformed(addr: str) -> bool:
    """Written as an IP address (digits and dots, or colons) that is none: 999.1.1.1.
    A host name is left to the node that resolves it (the launcher checks it there)."""
    numeric = all(c.isdigit() or c == "." for c in addr) or ":" in addr
    try:
        ipaddress.ip_address(addr.strip())
    except ValueError:
        return numeric
    return False


@register_rule(
    "DIST-MULTINODE-ADDR",
    "error",
    "several nodes without an address of node 0 that the other nodes can reach",
    probe=probes_dist.multinode_addr,
    libraries=("accelerate", "torch"),
)
def multinode_addr(ctx: LintContext) -> Hit | None:
    t = ctx.config.train
    if t.nnodes == 1:
        return None
    if not t.master_addr:
        return Hit(
            f"train.nnodes={t.nnodes} without train.master_addr: accelerate gives torchrun "
            "the endpoint 'None', and every node waits for node 0 until the rendezvous "
            "times out (10 min)",
            "set train.master_addr (or --master-addr) to node 0's address, the same on every node",
            "train.master_addr",
        )
    if malformed(t.master_addr):
        return Hit(
            f"train.master_addr {t.master_addr!r} is not an IP address: torchrun retries it "
            f"until the rendezvous times out ({t.rdzv_timeout_s} s)",
            "set train.master_addr (or --master-addr) to node 0's IP address or host name",
            "train.master_addr",
        )
    if not ctx.site.remote or not is_loopback(t.master_addr):
        return None  # loopback is node 0 itself for nodes on one machine
    return Hit(
        f"train.master_addr {t.master_addr} is a loopback address on {ctx.site.title}: on "
        "every other node it names that node itself, so its ranks wait for a node 0 that "
        "is not there until the rendezvous times out (10 min)",
        "set train.master_addr to node 0's address on the network the nodes share",
        "train.master_addr",
    )
