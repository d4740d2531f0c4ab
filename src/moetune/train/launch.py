"""`moetune train RUN --nproc N`: the same run on N processes, started by accelerate.

moetune writes no distributed code of its own. The launcher writes an accelerate config
into the run dir (`accelerate.yaml`, one strategy per registered writer) and runs
`python -m accelerate.commands.launch --config_file … -m moetune train …` – the very
command line it was given – in which every rank runs `train()` unchanged: the main
process alone ledgers, locks the run dir and writes its files (trainer.py, setup.py,
checkpoint.py), the others train their shard of each global batch. Several nodes
(train.nnodes, `--node-rank`, `--master-addr`): the same launch on each, nodes.py.

Facts this rests on (accelerate 1.15, checked by the DIST-* rules' probes):
- A CPU process (TrainingArguments.use_cpu) is MULTI_CPU over gloo whatever the config
  says: accelerate enters FSDP or DeepSpeed only on GPU-like devices. torch's FSDP2
  (fully_shard) runs on CPU over gloo all the same, so a CPU rank of an FSDP launch is
  switched to accelerate's FSDP path (fsdp_on_cpu) – that is how fsdp is tested here.
- DeepSpeed is entered for use_cpu=False only; on a host without CUDA such a rank is a CPU
  rank all the same, and with the gloo backend (setup.device_args) accelerate counts the world
  right and DeepSpeed's CPU accelerator runs ZeRO-3 over gloo – how zero3 is tested here.
  Beside a GPU, device cpu + zero3 is refused (DIST-SHARDED-CPU). On a machine's first
  ZeRO-3 run the CPU accelerator JIT-compiles its shm_comm op (~4 min on 2 loaded cores);
  a rank killed mid-build leaves torch's lock file, on which every later rank waits for
  ever (the hang seen before: py-spy shows FileBaton.wait under build_shm_op), so `make
  setup-deepspeed` builds it once.
- `accelerate launch` with `use_cpu` has no multi-process launcher except mpirun; the
  torchrun-based one (distributed_type MULTI_GPU / FSDP / DEEPSPEED) spawns the ranks, and
  each rank then picks its own backend (gloo on CPU, nccl on CUDA).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from moetune.config import RunConfig
from moetune.config.paths import anchor
from moetune.config.sections import TrainArgs
from moetune.io import atomic_write_text
from moetune.model.derive import causal_lm_class
from moetune.train.distributed import nodes
from moetune.train.distributed.ep_checks import check_expert_parallel
from moetune.train.distributed.launcher_output import LauncherOutput
from moetune.train.distributed.orphans import LAUNCHED_ENV, die_with_launcher, die_with_parent
from moetune.train.distributed.sharded_load import LOAD
from moetune.train.errors import TrainError
from moetune.train.result import TrainResult, finished_result
from moetune.train.rundir.checkpoint import RunDir, inspect_run

CONFIG_NAME = "accelerate.yaml"  # in the run dir, beside config.yaml
HEADER = "# written by `moetune train --nproc` for accelerate launch; regenerated on each launch\n"

Writer = Callable[[RunConfig, list[str]], dict[str, Any]]
STRATEGIES: dict[str, Writer] = {}


def strategy(name: str) -> Callable[[Writer], Writer]:
    """Register the accelerate config section writer of a train.strategy."""

    def decorate(writer: Writer) -> Writer:
        STRATEGIES[name] = writer
        return writer

    return decorate


@strategy("ddp")
def _ddp(cfg: RunConfig, layers: list[str]) -> dict[str, Any]:
    # MULTI_GPU selects accelerate's torchrun launcher; a CPU rank still runs gloo DDP.
    return {"distributed_type": "MULTI_GPU"}


@strategy("ep")
def _ep(cfg: RunConfig, layers: list[str]) -> dict[str, Any]:
    # DDP for the replicated weights' LoRA (and the gradient average that makes the experts'
    # LoRA exact); the experts themselves are placed by engine/expert_parallel.py
    if cfg.train.ep_degree is None:
        return {"distributed_type": "MULTI_GPU"}
    # train.ep_degree: the model arrives FSDP2-sharded on its 2-D mesh (ep_mesh.py), which
    # accelerate's FSDP2 path keeps; each rank loads its own experts, so nothing broadcasts
    section = _fsdp(cfg, layers)
    section["fsdp_config"].update(
        fsdp_cpu_ram_efficient_loading=False,
        fsdp_sync_module_states=False,
        # the units are ep_mesh.py's; accelerate would look the layer class up by name, and
        # fully_shard renamed it (FSDPQwen3MoeDecoderLayer)
        fsdp_auto_wrap_policy="NO_WRAP",
    )
    section["fsdp_config"].pop("fsdp_transformer_layer_cls_to_wrap")
    return section


@strategy("fsdp")
def _fsdp(cfg: RunConfig, layers: list[str]) -> dict[str, Any]:
    return {
        "distributed_type": "FSDP",
        "fsdp_config": {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": ",".join(layers),
            "fsdp_state_dict_type": "FULL_STATE_DICT",  # the peft adapter is saved whole
            "fsdp_reshard_after_forward": True,
            "fsdp_offload_params": False,
            # rank 0 loads (int8 / NF4 stacks: and quantises), the others build on meta and
            # get their shards (sharded_load.py) – every experts dtype
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_sync_module_states": True,
            # the trainer checkpoints through TrainingArguments, not FSDP's own
            "fsdp_activation_checkpointing": False,
        },
    }


@strategy("zero3")
def _zero3(cfg: RunConfig, layers: list[str]) -> dict[str, Any]:
    return {
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {
            "zero_stage": 3,
            "gradient_accumulation_steps": cfg.train.grad_accum,
            # transformers builds the base under zero.Init: each rank keeps its partition
            # from the load on (zero3_load.py); quantised / stored / offloaded bases are
            # still built whole on every rank and partitioned in prepare()
            "zero3_init_flag": True,
            # the adapter is saved whole (gathered); a step's checkpoint is DeepSpeed's own
            "zero3_save_16bit_model": True,
            "offload_optimizer_device": "none",
            "offload_param_device": "none",
            # several nodes through torchrun (as ddp / fsdp), not pdsh and a hostfile
            "deepspeed_multinode_launcher": "standard",
        },
    }


def decoder_layers(model_id: str) -> list[str]:
    """The classes FSDP wraps one by one: the causal-LM class's `_no_split_modules`
    (its decoder layer, e.g. Qwen3MoeDecoderLayer), read off the class without building it."""
    # lazy: heavy to import (transformers)
    from transformers import AutoConfig

    cls = causal_lm_class(AutoConfig.from_pretrained(model_id))
    return sorted(getattr(cls, "_no_split_modules", None) or [])


def accelerate_config(cfg: RunConfig, port: int, layers: list[str]) -> dict[str, Any]:
    """The accelerate config file's content for cfg.train.nproc processes on this machine,
    one of cfg.train.nnodes (`port`: this launch's own rendezvous when on one node)."""
    t = cfg.train
    precision = "bf16" if t.precision == "bf16" else "no"  # fp32 and auto: the trainer decides
    return {
        "compute_environment": "LOCAL_MACHINE",
        **nodes.machine_fields(t, port),
        "mixed_precision": precision,
        "use_cpu": False,  # True would pick accelerate's single-process launcher
        "rdzv_backend": "static",
        **STRATEGIES[t.strategy](cfg, layers),
    }


def free_port() -> int:
    """A TCP port nothing listens on now (the rendezvous of this launch)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launched() -> bool:
    """True inside a rank of a distributed launch (torchrun/accelerate set LOCAL_RANK)."""
    return "LOCAL_RANK" in os.environ or "WORLD_SIZE" in os.environ


def write_config(cfg: RunConfig, root: Path) -> Path:
    """accelerate.yaml in the run dir; a file of that name moetune did not write stays."""
    path = root / CONFIG_NAME
    if path.is_file() and not path.read_text(encoding="utf-8").startswith(HEADER):
        raise TrainError(
            f"{path} exists and was not written by moetune; it is never overwritten",
            "move it away, or run `accelerate launch --config_file it -m moetune train …`",
        )
    content = accelerate_config(cfg, free_port(), decoder_layers(cfg.model.id))
    atomic_write_text(path, HEADER + yaml.safe_dump(content, sort_keys=True))
    return path


def launch(cfg: RunConfig, argv: list[str], check: Callable[[], None]) -> dict[str, Any] | None:
    """Run `moetune <argv>` on cfg.train.nproc processes of this node; the result
    summary.json records (None on a node other than 0, which has no summary). `check` is
    the read-only run-dir check, done before anything is written."""
    nodes.check_nodes(cfg.train)
    nodes.check_port(cfg.train)
    check()
    nodes.await_master(cfg.train, _say)
    started = time.time()
    # node 0 of several: torchrun's trace of a rendezvous timeout is held for moetune's line
    held = cfg.train.nnodes > 1 and cfg.train.node_rank == 0
    output = LauncherOutput(sys.stderr.buffer) if held else None
    with nodes.config_home(cfg) as home:
        args = (write_config(cfg, home), [*rdzv_args(cfg), "-m", "moetune", *argv])
        code = _run_ranks(*args, output) if output else _run_ranks(*args)
    never_met = nodes.never_met(cfg, started) if code != 0 else None
    if output is not None:
        output.finish(rendezvous_said=never_met is not None)
    if code != 0:
        resumable = RunDir(Path(cfg.output.dir)).last_checkpoint() is not None
        raise never_met or _failed(cfg.train, code, resumable)
    if cfg.train.node_rank != 0:
        return None
    summary = json.loads((Path(cfg.output.dir) / "summary.json").read_text(encoding="utf-8"))
    return dict(summary["result"])


def _failed(t: TrainArgs, code: int, resumable: bool) -> TrainError:
    """`--resume` is offered only where a checkpoint was saved: before one it cannot help."""
    where = f" of node {t.node_rank} (of {t.nnodes})" if t.nnodes > 1 else ""
    then = "run the same command with --resume to continue" if resumable else "rerun it"
    return TrainError(
        f"the {t.nproc} training processes{where} failed (exit {code}); their error is above",
        f"fix that cause, then {then}",
    )


def rdzv_args(cfg: RunConfig) -> list[str]:
    """accelerate launch's own flags: the nodes' rendezvous timeout (torchrun's static
    rendezvous reads it from --rdzv_conf; accelerate's config file cannot set it)."""
    if cfg.train.nnodes == 1:
        return []
    return ["--rdzv_conf", f"timeout={cfg.train.rdzv_timeout_s}"]


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)  # stderr: stdout is the launcher's report


def _run_ranks(config: Path, argv: list[str], output: LauncherOutput | None = None) -> int:
    """accelerate launch, with `config`, of `argv` (its flags, then `-m moetune …`); its
    exit status. With `output`, what it prints goes through that (to finish after)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    env = {**os.environ, LAUNCHED_ENV: str(os.getpid())}  # the ranks watch this pid
    read, write = os.pipe() if output else (-1, 2)
    if output and sys.stderr.isatty():  # through a pipe, a terminal's bars stay bars
        columns = str(shutil.get_terminal_size().columns)
        env |= {"TTY_COMPATIBLE": "1", "COLUMNS": env.get("COLUMNS", columns)}
    # the ranks' stdout (DeepSpeed prints there) goes to stderr: stdout is the launcher's
    # report. A process group of their own: the launcher ends them all, stragglers included.
    proc = subprocess.Popen(
        [*cmd, *argv], env=env, stdout=write, stderr=write if output else None,
        preexec_fn=die_with_parent, process_group=0,
    )  # fmt: skip
    if output:
        os.close(write)  # the launcher holds the write end now
        output.start(read)
    try:
        return proc.wait()
    finally:
        if proc.poll() is None:  # Ctrl-C here: the ranks go too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # any rank the launcher left behind


def fsdp_on_cpu() -> None:
    """Let accelerate's own FSDP2 path run on CPU over gloo. accelerate 1.15 enters FSDP
    only for GPU-like distributed types and leaves a CPU rank MULTI_CPU (plain DDP), while
    torch's fully_shard runs on CPU/gloo. So the one change is the distributed type, set
    to FSDP with the plugin accelerate built from the launch config – the sharding,
    gathering and state dicts stay accelerate's and torch's. It acts only where accelerate
    says MULTI_CPU with an FSDP plugin (a GPU rank is FSDP already). Idempotent."""
    # lazy: heavy to import (accelerate)
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__
    if getattr(original, "_moetune", False):
        return

    def init(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    init._moetune = True  # type: ignore[attr-defined]
    AcceleratorState.__init__ = init  # type: ignore[method-assign]


def sharding(trainer: Any) -> dict[str, Any] | None:
    """What accelerate ran on this rank (None for one process): its distributed type and
    how much of the model this rank holds – FSDP2 keeps a DTensor shard of each parameter,
    ZeRO-3 a flat partition (ds_tensor) of each."""
    if trainer.args.world_size == 1:
        return None
    sizes = [_share(p) for p in trainer.model_wrapped.parameters()]
    return {
        "accelerate": str(trainer.accelerator.distributed_type.value),
        "world_size": trainer.args.world_size,
        "sharded_parameters": sum(sharded for _, _, sharded in sizes),
        "parameters": len(sizes),
        "local_share": round(sum(s[0] for s in sizes) / sum(s[1] for s in sizes), 4),
        **({"load": dict(LOAD)} if LOAD else {}),  # a sharded load's figures, every rank's
        **_expert_parallel(trainer.model),
    }


def _expert_parallel(model: Any) -> dict[str, Any]:
    """train.strategy ep: every rank's expert placement and the rows it moved."""
    # lazy: heavy to import (moetune's engine)
    import torch.distributed as dist

    from moetune.engine.expert_parallel import ep_report
    from moetune.train.distributed.ep_memory import rank_peak

    mine = ep_report(model)
    if mine is None:
        return {}
    mine |= rank_peak()  # every rank's own peak, not only the main rank's
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return {"expert_parallel": ranks}


def _share(param: Any) -> tuple[int, int, bool]:
    """(elements this rank holds, elements of the whole parameter, whether it is sharded)."""
    # lazy: heavy to import (torch)
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return param.to_local().numel(), param.numel(), True
    if hasattr(param, "ds_id"):  # DeepSpeed ZeRO-3 (its partition may carry padding)
        return param.ds_tensor.numel(), param.ds_numel, True
    return param.numel(), param.numel(), False


def rank_argv(config: Path, sets: list[str], flags: dict[str, bool]) -> list[str]:
    """The `moetune train` command line every rank runs (the settings as `--set`s)."""
    argv = ["train", str(config), *(arg for s in sets for arg in ("--set", s))]
    return argv + [f"--{name.replace('_', '-')}" for name, on in flags.items() if on]


def quiet_rank() -> bool:
    """A rank that reports nothing: any rank of a `--nproc` launch (the launcher reports),
    and the non-main ranks of a plain `accelerate launch`."""
    return bool(os.environ.get(LAUNCHED_ENV)) or int(os.environ.get("RANK", "0")) != 0


def launch_or_train(
    cfg: RunConfig, config: Path, sets: list[str], flags: dict[str, bool], train: Any
) -> Any:
    """`train(cfg, …)` here, or – several ranks (train.nproc × train.nnodes) outside a
    launch – on this node's nproc processes, after the same read-only run-dir check and
    preflight a rank would do first. A node other than 0 returns a `nodes.NodeDone`."""
    opts = {k: v for k, v in flags.items() if k != "json"}
    if nodes.world(cfg.train) == 1 or launched():
        die_with_launcher()  # again, should the rank not have come in by `python -m moetune`
        return train(cfg, progress=not flags.get("json"), **opts)

    cfg = anchor(cfg)  # as every rank sees it: a resume compares the paths it saved
    if opts["resume"] and (done := finished_result(cfg)) is not None:
        return done  # already complete: no rank is started
    nodes.check_one_process(cfg)  # before any rank starts (a rank would refuse with a trace)
    check_expert_parallel(cfg)  # train.strategy ep: experts that split, split LoRA on them

    def check() -> None:
        # lazy: heavy to import (moetune)
        from moetune.train.setup import as_run, preflight, resolve_placement
        from moetune.train.stored import check_stored_before_launch

        inspect_run(cfg, opts["resume"], opts["overwrite"], opts["overwrite_promoted"])
        check_stored_before_launch(cfg)  # a stored base each rank would refuse: refused here
        place = resolve_placement(cfg.train)
        nodes.check_devices(cfg.train, place.device)  # ranks ≤ GPUs, or ≤ cores on CPU
        nodes.check_host_ram(cfg)  # and their host RAM ≤ what is free
        preflight(as_run(cfg, place), opts["allow_errors"])

    result = launch(cfg, rank_argv(config, sets, flags), check)
    if result is None:
        return nodes.NodeDone(cfg.train.node_rank, cfg.train.nnodes, cfg.train.nproc)
    return TrainResult.from_json(result)
