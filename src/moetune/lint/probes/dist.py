"""Probes of the multi-process traps (lint/rules/dist.py): what accelerate really runs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from importlib import util

from moetune.lint.registry import ProbeOutcome, ProbeUnavailable

# The rank builds the Accelerator a CPU TrainingArguments builds (cpu=True) with an FSDP2
# plugin, as `accelerate launch` with distributed_type FSDP would, and prints what it got.
_FSDP_CPU_SCRIPT = """
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
if acc.is_main_process:
    print(acc.state.distributed_type, acc.state.backend)
"""


def fsdp_on_cpu() -> ProbeOutcome:
    """A CPU rank asking stock accelerate for a sharded strategy gets plain MULTI_CPU (DDP over
    gloo): its FSDP and DeepSpeed paths are for GPU-like devices only. moetune switches an
    FSDP rank over (train.distributed.fsdp_on_cpu); a ZeRO-3 rank is given use_cpu=False,
    which is the CPU only on a host without CUDA (train.distributed.device_args). One rank of
    a world of one (the env torchrun sets) shows it without a second process."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    rank = {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    env = {**os.environ, **rank, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    env |= {"ACCELERATE_USE_FSDP": "true", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _FSDP_CPU_SCRIPT],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if "DistributedType" in line]
    if done.returncode != 0 or not lines:
        raise ProbeUnavailable(f"the gloo rank failed: {done.stderr.strip()[-300:]}")
    return ProbeOutcome("FSDP" not in lines[0], f"a CPU rank with an FSDP2 plugin: {lines[0]}")


def deepspeed_missing() -> ProbeOutcome:
    """accelerate's ZeRO-3 needs the deepspeed package, which moetune does not install."""
    if util.find_spec("deepspeed") is not None:
        raise ProbeUnavailable("deepspeed is installed here, so the trap cannot show")
    # lazy: heavy to import (accelerate)
    from accelerate.utils import is_deepspeed_available

    return ProbeOutcome(
        not is_deepspeed_available(), "accelerate.utils.is_deepspeed_available() is False"
    )


def multinode_addr() -> ProbeOutcome:
    """Neither accelerate nor torch refuses a multi-node launch without a reachable node 0:
    accelerate hands torchrun the endpoint "None:PORT" for a missing main_process_ip, and
    a node whose address names no listening node 0 (a loopback address seen from node 1)
    retries until the rendezvous timeout (torch's static rendezvous: 600 s) – a long
    silent wait, not an error. Shown with accelerate's own launch arguments and one
    TCPStore client given 1.5 s."""
    # lazy: heavy to import (accelerate, torch)
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous

    argv = ["--multi_gpu", "--num_machines", "2", "--machine_rank", "1", "--num_processes", "2"]
    args, *_ = _validate_launch_command(launch_command_parser().parse_args([*argv, "x.py"]))
    prepare_multi_gpu_env(args)
    port, started = _closed_port(), time.monotonic()
    try:
        TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=1.5))
    except Exception:  # DistNetworkError once the timeout has passed
        waited = time.monotonic() - started
    else:
        raise ProbeUnavailable(f"something listens on 127.0.0.1:{port}")
    timeout = int(static_tcp_rendezvous._default_timeout_seconds)
    return ProbeOutcome(
        str(args.rdzv_endpoint).startswith("None:") and waited >= 1.4,
        f"accelerate's endpoint without an address: {args.rdzv_endpoint!r}; a TCPStore "
        f"client of a closed port waited {waited:.1f} s of its 1.5 s before failing; the "
        f"static rendezvous waits {timeout} s",
    )


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
