"""`moetune launch`: size the walls, build the pod spec, and run (or, dry, describe) the phases."""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

import moetune.plan
import moetune.plan.devices.sharding
from moetune.config import RunConfig
from moetune.data.rungs import check_ladder
from moetune.io import PROMOTION_FIX, promotion_broken
from moetune.lane.cards import CardChoice, choose_card
from moetune.lane.nodes import make_workers, node_plan
from moetune.lane.phases import PHASES, Lane, Walls
from moetune.lane.providers import provider_class
from moetune.lane.providers.base import LaneError, PodSpec, Provider
from moetune.lane.secrets import launch_secrets, scrub
from moetune.lane.state import LaneState
from moetune.model import load_spec
from moetune.plan.cost import walls as W
from moetune.plan.cost.estimate import Estimate, estimate, launch_signature, measured_cards


def make_provider(cfg: RunConfig, state_dir: Path) -> Provider:
    """The configured provider (its module is imported only when it is used)."""
    return provider_class(cfg.lane.provider).from_run(cfg, state_dir)


@dataclass
class LaunchPlan:
    """Everything `--dry-run` prints: card, pod spec, walls with numbers and reasons, phases,
    estimated time and cost."""

    run_id: str
    provider: str
    card: str | None
    spec: PodSpec
    walls: Walls
    why: dict[str, str]
    estimate: Estimate
    choice: CardChoice
    nodes: list[dict[str, Any]]  # each node's rank, host, pod and train command

    def to_json(self) -> dict[str, Any]:
        """The plan as printed: secret env values masked (they go to the pod, not a screen)."""
        est = self.estimate
        pod = self.spec.to_json()  # secret env values masked
        usd = None if est.estimated_usd is None else est.estimated_usd * len(self.nodes)
        return {
            "run_id": self.run_id,
            "provider": self.provider,
            "card": self.card,
            "card_choice": self.choice.to_json(),
            "pod": pod,
            "walls": {
                **asdict(self.walls),
                "env": pod["env"],  # the walls' env is the pod's
                "estimated_train_s": est.estimated_train_s,
                "estimated_eval_s": est.estimated_eval_s,
                "why": self.why,
            },
            "phases": [*PHASES, "teardown"],
            "estimate": est.to_json(),
            "nodes": self.nodes,
            "estimated_usd": usd,  # every node's pod: price × nodes
        }


def size_walls(cfg: RunConfig, spec: Any, plan: Any, est: Estimate) -> tuple[Walls, dict[str, str]]:
    """All four walls at once, each from the run's own numbers (config values win)."""
    volume = cfg.lane.volume_gb or W.required_volume_gb(
        spec, getattr(plan, "trainable_params", None)
    )
    train_s = est.estimated_train_s
    if cfg.lane.watchdog_s:
        watchdog, watchdog_why = cfg.lane.watchdog_s, "lane.watchdog_s"
    elif train_s is not None:
        watchdog = W.required_watchdog_s(train_s + est.setup_s, est.estimated_eval_s)
        watchdog_why = f"(setup + train + eval) × {W.WATCHDOG_MARGIN} margin; train: {est.basis}"
    else:
        watchdog = W.DEFAULT_WATCHDOG_S
        watchdog_why = (
            "no token count (set train.max_steps, or local text data files): "
            f"the {W.DEFAULT_WATCHDOG_S / 3600:g} h floor"
        )
    floor = spec.total_params >= W.LARGE_MODEL_PARAMS
    why = {
        "volume_gb": "lane.volume_gb" if cfg.lane.volume_gb else (
            f"{W.snapshot_bytes(spec) / W.GB:.1f} GB snapshot + checkpoints + adapter, "
            f"+{W.VOLUME_HEADROOM_FRACTION:.0%} +{W.VOLUME_FIXED_HEADROOM_GB} GB headroom"
            + (f", at least {W.LARGE_MODEL_VOLUME_FLOOR_GB} GB for a ≥30B model" if floor else "")
        ),
        "watchdog_s": watchdog_why,
        "env": f"{W.XET_ENV}=1 before any Python starts: hf-xet flakes on big pulls",
    }  # fmt: skip
    env = {**cfg.lane.env, W.XET_ENV: "1"}  # never one wall at a time: xet is always off
    return Walls(volume, watchdog, env), why


def pod_gpu_count(cfg: RunConfig, spec: Any, card: Any) -> int:
    """GPUs per pod: lane.runpod.gpu_count, else train.nproc when > 1, else the fewest GPUs
    the per-device planner (plan.sharding) fits the run on (1 without a card)."""
    if cfg.lane.runpod.gpu_count:
        return cfg.lane.runpod.gpu_count
    if cfg.train.nproc > 1:
        return cfg.train.nproc
    if card is None:
        return 1
    # looked up on use (tests stand in for it); None: fits no count
    return int(moetune.plan.devices.sharding.fewest_gpus(spec, cfg, card, cfg.train.strategy) or 1)


def launch_plan(
    cfg: RunConfig, run_id: str | None = None, accept_thin_margin: bool = False
) -> LaunchPlan:
    provider_class(cfg.lane.provider).check_nodes(cfg)  # before anything is sized or written
    spec = load_spec(cfg.model.id, cfg.model.trust_remote_code)
    plan = moetune.plan.make_plan(spec, cfg)  # looked up on use: tests stand in for it
    measured = measured_cards(cfg.output.ledger, launch_signature(spec, cfg))
    choice = choose_card(cfg, plan, measured, accept_thin_margin)
    card = choice.card
    setup_s = provider_class(cfg.lane.provider).setup_s
    est = estimate(spec, cfg, card, cfg.output.ledger, setup_s)  # a measured rate wins
    walls, why = size_walls(cfg, spec, plan, est)
    run_id = run_id or f"{Path(cfg.output.dir).name}-{time.strftime('%Y%m%d-%H%M%S')}"
    pod = PodSpec(
        name=f"moetune-{run_id}-{secrets.token_hex(3)}",
        card=getattr(card, "id", None),
        gpu_type_id=getattr(card, "runpod_gpu_type_id", None),
        gpu_count=pod_gpu_count(cfg, spec, card),
        nodes=cfg.train.nnodes,
        image=cfg.lane.runpod.image,
        volume_gb=walls.volume_gb,
        container_disk_gb=cfg.lane.runpod.container_disk_gb,
        env=walls.env,
        cloud_type=cfg.lane.runpod.cloud_type,
        public_env=tuple(cfg.lane.public_env),
    )
    hidden = launch_secrets(cfg)  # masked in the plan, the task file and every later output
    shown = [{**n, "command": scrub(n["command"], hidden)} for n in node_plan(cfg, pod)]
    return LaunchPlan(run_id, cfg.lane.provider, pod.card, pod, walls, why, est, choice, shown)


def launch(
    cfg: RunConfig,
    config_path: Path,
    *,
    resume: str | None = None,
    show: bool = True,
    accept_thin_margin: bool = False,
) -> LaneState:
    """Run the phases (a new launch, or the one `resume` names) on train.nnodes nodes.
    Refused, before anything is written, when the only card that fits keeps less than the
    margin and that was not accepted, or the provider cannot place that many nodes."""
    if resume:
        refuse_swapped_adapter(cfg)
        state = LaneState.load(cfg.output.ledger, resume)
        state.pid = os.getpid()
        state.accept_thin_margin = state.accept_thin_margin or accept_thin_margin
        plan = launch_plan(cfg, state.run_id, state.accept_thin_margin)
        plan.choice.require()
        plan.spec = PodSpec(**{**asdict(plan.spec), "name": state.pod_name})
    else:
        check_ladder(cfg.eval)  # an eval the pod would refuse after training: refused here
        refuse_existing_output(cfg)
        plan = launch_plan(cfg, accept_thin_margin=accept_thin_margin)
        plan.choice.require()
        state = LaneState(
            plan.run_id, cfg.lane.provider, str(config_path.resolve()), plan.spec.name,
            accept_thin_margin=accept_thin_margin,
        )  # fmt: skip
    state.save(cfg.output.ledger)
    provider = make_provider(cfg, state.dir(cfg.output.ledger))
    workers = make_workers(provider, cfg, plan.spec, state.dir(cfg.output.ledger))
    console = Console(stderr=True, quiet=not show)
    return Lane(cfg, provider, state, plan.walls, plan.spec, console, workers).run()


def refuse_swapped_adapter(cfg: RunConfig) -> None:
    """A resumed launch whose banked adapter was replaced after its promotion stops here:
    the run would report the new bytes as promoted."""
    if why := promotion_broken(Path(cfg.output.dir) / "adapter"):
        raise LaneError(why, PROMOTION_FIX)


def refuse_existing_output(cfg: RunConfig) -> None:
    out = Path(cfg.output.dir)
    if out.exists() and any(out.iterdir()):
        raise LaneError(
            f"{out} already holds a run; a launch never overwrites one",
            "set output.dir to a new folder, or continue with --resume RUN_ID",
        )
