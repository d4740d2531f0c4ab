"""Per-device memory of a data-parallel run on N GPUs, by component, and per card the
fewest GPUs that fit.

Built on the single-device analytic peak (`plan.analytic`): each of its components is
either sharded 1/N or replicated on every rank, and each strategy adds what it holds on
top (the gathered layers' transient, communication buffers). Every rank runs its own
micro-batch (`train.batch_size` sequences), so activations, logits and peft's W+ΔW copies
(made from the gathered weights) are per device and not sharded.

Strategies (a registry: `STRATEGIES`, extend with `register`):

- ``ddp`` – DistributedDataParallel: every rank holds everything. Its Reducer copies the
  gradients into flat buckets for the all-reduce (`gradient_as_bucket_view=False`, the
  default): one more copy of every trainable gradient.
- ``fsdp`` – FSDP2 (`fully_shard` on each decoder layer, then on the model): frozen and
  trainable weights, gradients, optimizer state and its transients sharded 1/N. A layer
  is all-gathered to full size while it runs, with the next one prefetched (2 in flight);
  the root unit (embeddings, final norm, LM head) stays gathered from the forward through
  the backward (FSDP2 does not reshard the root after forward). In backward the layer's
  full-size gradient waits for its reduce-scatter (the communication buffer).
- ``zero3`` – DeepSpeed ZeRO-3 with DeepSpeed's own defaults (deepspeed/runtime/zero/
  config.py): parameters gathered per module (the largest is one layer's expert stacks)
  plus `stage3_prefetch_bucket_size` = 5e7 elements ahead, capped by
  `stage3_max_live_parameters` = 1e9; parameters under `stage3_param_persistence_threshold`
  = 1e5 elements (norms) stay whole on every rank; gradients reduced through a
  `reduce_bucket_size` = 5e8-element bucket in the weights' dtype; the bf16 engine keeps a
  bf16 working copy of the trainable weights beside the fp32 master (2 B more per
  trainable parameter, sharded). (HF Trainer's "auto" values size the buckets from the
  hidden size instead: hidden², 0.9·hidden².)

Approximations, stated: the transient is added to the single-device peak's phase even
when that phase is the optimizer step (when FSDP2 has resharded): an upper bound by at
most the transient. NCCL's own buffers live outside the PyTorch allocator and are not
counted. ddp / fsdp / zero3 shard experts like any weight.

- ``ep`` – moetune's expert parallelism (engine/expert_parallel.py): the frozen routed
  expert stacks 1/N (E/N experts a rank) and their LoRA weights, gradients and optimizer
  state 1/N, everything else replicated with DDP's gradient buckets, plus one layer's
  all-to-all receive buffers at balanced routing (`plan.devices.expert_parallel.EP_SKEW`
  states the skew).
  With train.ep_degree: E/ep_degree experts a rank, the rest FSDP2-sharded 1/N.
  `plan_expert_parallel` (`DeviceReport.expert_parallel`) gives the same figure, the held
  expert stacks split out, beside any strategy; `fewest_gpus` offers only counts ep runs on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moetune.config import RunConfig
from moetune.config.ep_split import check_ep_split
from moetune.errors import ConfigError
from moetune.model.spec import ModelSpec
from moetune.plan.analytic import AnalyticEstimate
from moetune.plan.devices.ep_step import EpStepTime, ep_step_time
from moetune.plan.devices.expert_parallel import (
    ENGINES,
    EP_SKEW,
    ExpertParallelPlan,
    ddp_bucket_bytes,
    ep_skew,
    split_trainable,
)
from moetune.plan.devices.host_ram import HostRam, host_ram, load_notes
from moetune.plan.devices.sizes import Sizes, run_sizes
from moetune.plan.devices.sizes import zero3_partitioned as zero3_partitioned  # its old home
from moetune.plan.fit import CardFit, card_fit
from moetune.plan.hardware import Card, get_card
from moetune.plan.profiles.registry import uncalibrated
from moetune.units import human_bytes

SHARDED = ("frozen_weights", "trainable_weights", "gradients", "optimizer_state",
           "optimizer_transients")  # fmt: skip
PREFETCH_LAYERS = 2  # FSDP2: the running layer and the prefetched next one
DS_PREFETCH_BUCKET = 50_000_000  # stage3_prefetch_bucket_size default (elements)
DS_MAX_LIVE = 1_000_000_000  # stage3_max_live_parameters default (elements)
DS_REDUCE_BUCKET = 500_000_000  # reduce_bucket_size default (elements)
DS_PERSISTENCE = 100_000  # stage3_param_persistence_threshold default (elements)
MAX_GPUS = 64


@dataclass(frozen=True)
class DevicePlan:
    """One rank's peak on `gpus` devices with `strategy`; `components` sum to `peak_bytes`."""

    strategy: str
    gpus: int
    card: str
    components: dict[str, int]
    fit: CardFit
    single_device_bytes: int  # the analytic single-device peak it was derived from
    notes: tuple[str, ...] = ()

    @property
    def peak_bytes(self) -> int:
        return sum(self.components.values())

    @property
    def fits(self) -> bool:
        return self.fit.fits

    def to_json(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "gpus": self.gpus,
            "card": self.card,
            "components": dict(self.components),
            "peak_bytes": self.peak_bytes,
            "single_device_bytes": self.single_device_bytes,
            "fits": self.fits,
            **{k: v for k, v in self.fit.to_json().items() if k != "fits"},
            "notes": list(self.notes),
        }


Terms = Callable[[Sizes, int], dict[str, int]]


@dataclass(frozen=True)
class Strategy:
    """How one strategy places the components on each of N ranks."""

    name: str
    description: str
    extra: Terms  # the strategy's own terms (transient, communication) on N ranks
    sharded: tuple[str, ...] = SHARDED
    notes: tuple[str, ...] = field(default_factory=tuple)
    places_experts: bool = False  # E/N routed experts a rank: N must divide E

    def components(self, sizes: Sizes, gpus: int) -> dict[str, int]:
        out = {k: (-(-v // gpus) if k in self.sharded else v) for k, v in sizes.single.items()}
        return {**out, **self.extra(sizes, gpus)}


STRATEGIES: dict[str, Strategy] = {}


def register(strategy: Strategy) -> None:
    STRATEGIES[strategy.name] = strategy


def get_strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ConfigError(
            f"unknown strategy {name!r}", f"use one of: {', '.join(STRATEGIES)}"
        ) from None


def _ddp(s: Sizes, gpus: int) -> dict[str, int]:
    return {"gathered_transient": 0, "communication_buffers": s.trainable_params * s.grad_bytes}


def _fsdp(s: Sizes, gpus: int) -> dict[str, int]:
    # the full-size gradient of the layer in backward, plus its reduce-scatter output shard
    comm = s.largest_layer_grads + -(-s.largest_layer_grads // gpus)
    return {
        "gathered_transient": s.root + PREFETCH_LAYERS * s.largest_layer,
        "communication_buffers": comm,
    }


def _zero3(s: Sizes, gpus: int) -> dict[str, int]:
    live = s.largest_module + min(DS_PREFETCH_BUCKET, max(0, DS_MAX_LIVE - s.largest_module))
    bucket = min(DS_REDUCE_BUCKET, s.trainable_params) * s.weight_bytes
    return {
        "gathered_transient": live * s.weight_bytes,
        "persistent_params": s.persistent,
        "master_copy": -(-s.trainable_params * s.weight_bytes // gpus),
        "communication_buffers": bucket,
    }


register(Strategy("ddp", "DistributedDataParallel: all replicated, gradient buckets", _ddp, ()))
register(Strategy("fsdp", "FSDP2 per decoder layer: all sharded, 2 layers gathered", _fsdp))
register(Strategy("zero3", "DeepSpeed ZeRO-3 (default buckets)", _zero3))


def _ep(s: Sizes, gpus: int) -> dict[str, int]:
    # moetune's ep: E/N routed experts a rank and their LoRA state only, the rest
    # replicated (DDP's gradient buckets: the replicated LoRA)
    if s.ep_degree is not None:
        return _ep_groups(s, gpus, s.ep_degree)
    held = s.single.get("frozen_weights", 0) - s.expert_weights + -(-s.expert_weights // gpus)
    copies = s.single.get("expert_weight_copies")  # peft's W+ΔW of the experts it holds
    buckets = ddp_bucket_bytes(s.trainable_params, s.expert_share, s.grad_bytes)
    return {
        "frozen_weights": held,
        **({} if copies is None else {"expert_weight_copies": -(-copies // gpus)}),
        **split_trainable(s.single, s.expert_share, gpus),
        "gathered_transient": 0,
        "communication_buffers": buckets,
        "all_to_all_buffers": s.all_to_all,
    }


def _ep_groups(s: Sizes, gpus: int, degree: int) -> dict[str, int]:
    """train.ep_degree (train/distributed/ep_mesh.py): E/degree routed experts a rank, and
    everything else – the rest of the frozen weights, all the LoRA, its gradients and
    optimizer state – FSDP2-sharded 1/N, with FSDP2's gathered layer and buffers."""
    rest = s.single.get("frozen_weights", 0) - s.expert_weights
    copies = s.single.get("expert_weight_copies")
    return {
        "frozen_weights": -(-rest // gpus) + -(-s.expert_weights // degree),
        **({} if copies is None else {"expert_weight_copies": -(-copies // degree)}),
        **{k: -(-s.single.get(k, 0) // gpus) for k in SHARDED[1:]},
        **_fsdp(s, gpus),
        "all_to_all_buffers": s.all_to_all,
    }


register(Strategy("ep", "expert parallelism: E/N routed experts a rank, all-to-all", _ep, (),
                  (EP_SKEW,), places_experts=True))  # fmt: skip


def plan_expert_parallel(
    spec: ModelSpec, cfg: RunConfig, gpus: int, sizes: Sizes | None = None
) -> ExpertParallelPlan | None:
    """The ep figure beside any strategy: one rank's bytes as `--strategy ep` plans them on
    `gpus` ranks (the same components, the experts' held stacks split out) – E/N experts a
    rank (EP ≤ E: a wider count is planned at EP = E), or with train.ep_degree E/ep_degree a
    rank and the rest FSDP2-sharded over all `gpus`. None for a dense model or one device."""
    if gpus < 2 or not spec.is_moe or not spec.num_experts:
        return None
    sizes = sizes or run_sizes(spec, cfg)
    degree = cfg.train.ep_degree or min(gpus, spec.num_experts)
    ranks = gpus if cfg.train.ep_degree else degree
    parts = get_strategy("ep").components(sizes, ranks)
    experts = -(-sizes.expert_weights // degree)
    parts = {"frozen_weights": parts.pop("frozen_weights") - experts,
             "expert_weights": experts, **parts}  # fmt: skip
    engines = ENGINES if cfg.train.tuning == "full" else ()
    worst = parts["all_to_all_buffers"] * degree  # a group's tokens all routed to one rank
    over = ranks if cfg.train.ep_degree else None
    return ExpertParallelPlan(degree, -(-spec.num_experts // degree), parts, engines, worst,
                              cfg.train.ep_placement, over)  # fmt: skip


# ---------------------------------------------------------------- plans


def _card(card: Card | str) -> Card:
    return card if isinstance(card, Card) else get_card(card)


def _check_gpus(gpus: int) -> None:
    if not isinstance(gpus, int) or gpus < 1:
        raise ConfigError(f"--gpus {gpus!r} is not a positive whole number", "pass --gpus N >= 1")


def plan_devices(
    spec: ModelSpec,
    cfg: RunConfig,
    card: Card | str,
    gpus: int,
    strategy: str,
    sizes: Sizes | None = None,
) -> DevicePlan:
    """Each rank's peak by component on `gpus` cards of `card` with `strategy`, and its fit
    (live peak + the card's overhead ≤ usable). `sizes` reuses one `run_sizes`."""
    _check_gpus(gpus)
    chosen, strat = _card(card), get_strategy(strategy)
    if strat.places_experts:
        experts = spec.num_experts if spec.is_moe else None
        check_ep_split(spec.name, experts, gpus, cfg.train.ep_degree)  # the launcher's checks
    sizes = sizes or run_sizes(spec, cfg)
    components = strat.components(sizes, gpus)
    peak = sum(components.values())
    return DevicePlan(
        strategy=strat.name,
        gpus=gpus,
        card=chosen.id,
        components=components,
        fit=card_fit(chosen, peak),
        single_device_bytes=sum(sizes.single.values()),
        notes=tuple(ep_skew(cfg) if n == EP_SKEW else n for n in strat.notes),  # its placement
    )


def per_rank_bytes(
    spec: ModelSpec,
    cfg: RunConfig,
    gpus: int,
    strategy: str,
    est: AnalyticEstimate | None = None,
) -> dict[str, int]:
    """One rank's live bytes by component (no card, no overhead): what a measured per-rank
    peak (`torch.cuda.max_memory_allocated`, or a byte tracker on CPU) compares with.
    `est`: the single-device estimate to split (default: `analytic(spec, cfg)`)."""
    _check_gpus(gpus)
    return get_strategy(strategy).components(run_sizes(spec, cfg, est), gpus)


def fewest_gpus(
    spec: ModelSpec,
    cfg: RunConfig,
    card: Card | str,
    strategy: str,
    max_gpus: int = MAX_GPUS,
    *,
    sizes: Sizes | None = None,
) -> int | None:
    """The fewest GPUs of `card` on which each rank fits with `strategy`; None when even
    `max_gpus` do not (DDP replicates everything: it fits on 1 or never), or – a base kept as
    stored under any strategy but ep, which the launcher refuses on several processes
    (train/stored.py) – when one GPU does not (`fewest_limit`)."""
    _check_gpus(max_gpus)
    strat = get_strategy(strategy)
    sizes = sizes or run_sizes(spec, cfg)
    for n in range(1, fewest_limit(sizes, strategy, max_gpus) + 1):
        if strat.places_experts and not _ep_count(spec, n, cfg.train.ep_degree):
            continue  # counts the launcher refuses under ep
        if plan_devices(spec, cfg, card, n, strategy, sizes).fits:
            return n
    return None


def fewest_limit(sizes: Sizes, strategy: str, max_gpus: int = MAX_GPUS) -> int:
    """The most GPUs `fewest_gpus` tries: one for a base kept as stored under a strategy
    that does not place the experts (on several processes only ep trains it)."""
    return 1 if sizes.stored and not get_strategy(strategy).places_experts else max_gpus


def _ep_count(spec: ModelSpec, n: int, ep_degree: int | None) -> bool:
    """Whether ep runs on `n` ranks: the launcher's checks (config/ep_split.py) pass."""
    try:
        check_ep_split(spec.name, spec.num_experts, n, ep_degree)
    except ConfigError:
        return False
    return True


@dataclass(frozen=True)
class DeviceReport:
    """`moetune plan --gpus N --strategy S`: one rank's plan per card, and per card the
    fewest GPUs that fit (None: not even `MAX_GPUS`)."""

    strategy: str
    gpus: int  # ranks in all: nodes × GPUs per node
    plans: dict[str, DevicePlan]
    fewest: dict[str, int | None]
    notes: tuple[str, ...] = ()
    nodes: int = 1
    expert_parallel: ExpertParallelPlan | None = None  # EP over every rank (as ep trains)
    host: HostRam | None = None  # the load's host RAM per node (sharded strategies)
    ep_steps: dict[str, EpStepTime] = field(default_factory=dict)  # ep: step time per card
    fewest_limit: int = MAX_GPUS  # the most GPUs `fewest` tried (1: a stored base, not ep)

    @property
    def placement(self) -> str:
        """ "16 GPU(s)", or "2 nodes × 8 GPU(s)" for several nodes."""
        if self.nodes == 1:
            return f"{self.gpus} GPU(s)"
        return f"{self.nodes} nodes × {self.gpus // self.nodes} GPU(s)"

    @property
    def launches(self) -> bool:
        """Whether the launcher starts this many ranks with this strategy: not several for a
        base kept as stored outside ep (`fewest_limit` 1; train/stored.py refuses it)."""
        return self.gpus == 1 or self.fewest_limit > 1

    @property
    def components(self) -> dict[str, int]:
        """Per-rank components (the same on every card: only the fit differs)."""
        return next(iter(self.plans.values())).components if self.plans else {}

    def to_json(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "gpus": self.gpus,
            "nodes": self.nodes,
            "gpus_per_node": self.gpus // self.nodes,
            "components": dict(self.components),
            "peak_bytes": sum(self.components.values()),
            "cards": {
                c: {**p.to_json(), "fewest_gpus": self.fewest[c]} for c, p in self.plans.items()
            },
            "fewest_gpus_limit": self.fewest_limit,
            "launches": self.launches,
            "notes": list(self.notes),
            "expert_parallel": self._expert_parallel_json(),
            "host_ram": self.host.to_json() if self.host else None,
            "ep_step_time": {c: t.to_json() for c, t in self.ep_steps.items()},
        }

    def _expert_parallel_json(self) -> dict[str, Any] | None:
        ep = self.expert_parallel
        if ep is None:
            return None
        fits = {c: card_fit(get_card(c), ep.peak_bytes).fits for c in self.plans}
        return {**ep.to_json(), "fits": fits}


def device_report(
    spec: ModelSpec, cfg: RunConfig, cards: list[str], gpus: int, strategy: str, nodes: int = 1
) -> DeviceReport:
    """Per card: one rank's plan on `nodes` × `gpus` GPUs with `strategy`, and the fewest
    that fit. Host RAM is a wall per node: each node loads for its own `gpus` ranks."""
    _check_gpus(gpus)
    if not isinstance(nodes, int) or nodes < 1:
        raise ConfigError(f"--nodes {nodes!r} is not a positive whole number", "pass --nodes >= 1")
    get_strategy(strategy)
    sizes = run_sizes(spec, cfg)
    ranks = nodes * gpus
    plans = {c: plan_devices(spec, cfg, c, ranks, strategy, sizes) for c in cards}
    fewest = {c: fewest_gpus(spec, cfg, c, strategy, sizes=sizes) for c in cards}
    host = host_ram(sizes, gpus, strategy, ranks) if strategy != "ddp" else None
    notes = _report_notes(spec) + load_notes(host)
    notes += _node_notes(sizes, nodes, gpus, host) + _stored_notes(sizes, strategy)
    ep = plan_expert_parallel(spec, cfg, ranks, sizes)
    notes += (ep.describe(), *_ep_or_fsdp(ep, sizes, ranks, sizes.stored)) if ep else ()
    name = get_strategy(strategy).name
    steps = _ep_steps(spec, cfg, cards, gpus, nodes) if name == "ep" and ranks > 1 else {}
    notes += tuple(t.describe() for t in list(steps.values())[:1])
    limit = fewest_limit(sizes, strategy)
    return DeviceReport(name, ranks, plans, fewest, notes, nodes, ep, host, steps, limit)


def _stored_notes(sizes: Sizes, strategy: str) -> tuple[str, ...]:
    """Why a stored base's fewest GPUs stop at one under this strategy."""
    if fewest_limit(sizes, strategy) > 1:
        return ()
    return (
        f"a base kept as stored trains on several processes with --strategy ep only (the "
        f"launcher refuses {get_strategy(strategy).name} there): the fewest GPUs above is 1 "
        "or none; plan --strategy ep for several GPUs, or set model.quantized_base: "
        "dequantize",
    )


def _ep_steps(
    spec: ModelSpec, cfg: RunConfig, cards: list[str], gpus: int, nodes: int
) -> dict[str, EpStepTime]:
    """Per card: one ep rank's compute and all-to-all seconds on `nodes` × `gpus`."""
    return {c: ep_step_time(spec, cfg, get_card(c), gpus, nodes) for c in cards}


def _ep_or_fsdp(ep: ExpertParallelPlan, sizes: Sizes, ranks: int, stored: bool) -> tuple[str, ...]:
    """Which of ep and FSDP2 holds less per device, said where FSDP2 does (moetune trains
    both; ep moves only the routed tokens, FSDP2 all-gathers every layer's whole stacks).
    Never for a base kept as stored: on several processes only ep trains it."""
    fsdp = sum(get_strategy("fsdp").components(sizes, ranks).values())
    if ep.engines or stored or fsdp >= ep.peak_bytes:
        return ()
    why = "it shards the replicated rest too"
    if ep.sharded_over:  # train.ep_degree: the rest is sharded; the experts over a group only
        why = f"it shards the experts over all {ranks} ranks, ep over groups of {ep.ep}"
    return (
        f"FSDP2 holds less per device here: {human_bytes(fsdp)} against ep's "
        f"{human_bytes(ep.peak_bytes)} on {ranks} ranks ({why}); "
        "use --strategy fsdp where ep does not fit, ep where both do (it moves only the "
        "routed tokens, FSDP2 gathers every layer's whole expert stacks)",
    )


def node_host_ram(sizes: Sizes, gpus: int, host: HostRam | None = None) -> int:
    """Host RAM one node needs at load for its own `gpus` ranks (a node's RAM never depends
    on the other nodes): the sharded load's figure, or – ddp – each rank's whole base."""
    if host is not None:
        return host.per_node_bytes
    return gpus * (sizes.single.get("frozen_weights", 0) + sizes.single.get("trainable_weights", 0))


def _node_notes(sizes: Sizes, nodes: int, gpus: int, host: HostRam | None) -> tuple[str, ...]:
    if nodes == 1:
        return ()
    return (
        f"{nodes} nodes × {gpus} GPU(s) = {nodes * gpus} ranks: each rank's peak above is "
        f"of the {nodes * gpus}; per node: {gpus} GPU(s) and about "
        f"{human_bytes(node_host_ram(sizes, gpus, host))} of host RAM at load (its own "
        f"{gpus} ranks)",
    )


def _report_notes(spec: ModelSpec) -> tuple[str, ...]:
    """The per-device split is of the analytic: say what it leaves out for this model."""
    kinds = uncalibrated(spec)
    if not kinds:
        return ()
    return (
        f"per-device figures split the analytic, which has no calibrated activation term for "
        f"{spec.model_type}'s {', '.join(kinds)} layers: their activations are left out",
    )
