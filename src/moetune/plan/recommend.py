"""The cheapest config changes that make a run fit a card (the plan's best per card).

Options – combinations of the dimensions below – are walked in order of total quality
cost and re-planned with the analytic estimator (≈ 5 ms each, MAX_CANDIDATES at most);
each card keeps the cheapest fitting ones that are not a superset of a cheaper fitting
one. Dimensions: on/off `MOVES`; one frozen-expert storage of `STORAGES` (int8, or NF4
with double quant – both need and set `lora.engine: moetune`); halvings of the expert
rank alone (`lora.expert_rank`), of the whole rank, and of the sequence length.

Quality costs, lower first – set in one place, `COSTS` (plan/moves.py, beside the moves):

    engine switch, bitsandbytes → bf16 0     same adapter and numerics (split LoRA: fp32 1e-5)
    a published base kept as stored   0     the same weights, dequantised one expert at a time
    explicit expert targets           0.05  rank r on gate_up instead of peft's 2r
    gradient checkpointing on         0.1   same result, ≈ 30 % slower
    batch → 1 (+ accumulation)        0.2   same effective batch, slower
    int8 frozen experts               0.25  ≈ 0.6 % relative output error per projection
    LoRA instead of full              0.5
    NF4 frozen experts (+ dq)         0.6   ≈ 9 %: LoRA learns on a perturbed base
                                             (QLoRA-grade); double quant costs nothing
    halving the expert rank           0.7   per halving; attention keeps its rank
    halving the whole rank            1.0   per halving (= experts 0.7 + attention 0.3)
    dropping dense / shared / attention LoRA   1.1 / 1.2 / 1.6   (experts: never)
    halving the sequence length       2.0   per halving, to 256: the data itself changes

Experts are never dropped: an MoE fine-tune that leaves its experts untrained is not the
same run. When nothing searched fits a card, offloading the frozen experts (host RAM, else
disk: `plan.offload`) is offered – as configured, else after the leanest changes – with its
tok/s estimate (a speed cost, no quality cost); when that does not fit either, the plan
says so. Rank floors are 4 for
the expert stacks as for the whole rank: on Qwen3-30B-A3B the r=4 expert adapter with
its gradient and Adam state is ≈ 2.3 GiB, so one more halving saves ≈ 1.2 GiB – it
rarely makes a card fit, while each expert (seeing ≈ k/E of the tokens) is left with
two directions to adapt in.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import partial

from moetune.config import RunConfig
from moetune.config.keys import lora_stack, splits, wraps
from moetune.errors import MoetuneError
from moetune.model.derive import checkpointing_refused
from moetune.model.spec import ModelSpec
from moetune.plan.analytic import AnalyticEstimate
from moetune.plan.fit import GiB, Recommendation, analytic, card_fit
from moetune.plan.hardware import Card
from moetune.plan.moves import (
    COSTS,
    LEVEL,
    MOVES,
    STORAGES,
    Move,
    Storage,
    with_lora,
    with_train,
)
from moetune.plan.offload.memory import fitting_offload, offload_recommendation
from moetune.plan.stored import held_as, published_format, restored

MAX_CANDIDATES = 800  # analytic re-plans per plan at most (≈ 5 ms each)
RECS_PER_CARD = 3
ALTERNATIVES_WITHIN = 1.0  # quality cost above a card's best that alternatives may add
MIN_RANK = MIN_EXPERT_RANK = 4
MIN_SEQ = 256


@dataclass(frozen=True)
class _Option:
    """One point of the search: a config is built from it only when it is evaluated."""

    cost: float
    moves: frozenset[str]  # a fitting option makes every superset redundant
    subset: tuple[Move, ...]
    storage: Storage | None
    expert_steps: int  # halvings of the expert rank alone
    rank_steps: int  # halvings of the whole rank (experts included)
    seq_steps: int


@dataclass(frozen=True)
class _Candidate:
    cfg: RunConfig
    option: _Option
    changes: tuple[str, ...]
    overrides: tuple[str, ...]


# ---------------------------------------------------------------- the search space


def _options(cfg: RunConfig, spec: ModelSpec) -> list[_Option]:
    """Every combination of the dimensions, cheapest first."""
    out = []
    storages = [None, *_storages(cfg, spec)]
    for subset in _move_subsets(cfg, spec):
        names = {m.name for m in subset}
        for storage in storages:
            if storage is not None and "engine" in names:
                continue  # a storage sets the engine itself: the same candidate
            for r, e, s in _rank_and_seq_steps(cfg, spec, names):
                option = _option(cfg, spec, subset, storage, (e, r, s))
                if option.moves:
                    out.append(option)
    return sorted(out, key=lambda o: (o.cost, len(o.moves)))


def refuses_checkpointing(spec: ModelSpec) -> str | None:
    """The name of the spec's causal-LM class when it refuses activation checkpointing
    (jetmoe), else None; a hand-made spec or a class transformers lacks: None."""
    if not spec.mixers:  # not read off a build: no class to ask
        return None
    try:
        return checkpointing_refused(spec)
    except MoetuneError:  # a class transformers does not ship (remote code): nothing known
        return None


def _usable_moves(cfg: RunConfig, spec: ModelSpec) -> list[Move]:
    absent = {k for k, has in _parts(spec).items() if not has}
    if not published_format(spec):
        absent.add("as_stored")
    if not (_split_serves(cfg, spec) and _on_peft(cfg, spec)):
        absent.add("engine")
    if refuses_checkpointing(spec):  # never recommend what the class refuses
        absent.add("gc")
    return [m for m in MOVES if m.name not in absent and m.apply(cfg) is not None]


def _split_serves(cfg: RunConfig, spec: ModelSpec) -> bool:
    """moetune's split LoRA can run this run's experts (quantised storage needs it)."""
    peft = lora_stack(cfg.lora.stack).peft_adapter
    if not (spec.is_moe and "experts" in cfg.lora.targets and peft):
        return False
    # lazy: heavy to import (torch, peft via moetune.engine)
    from moetune.engine.resolve import split_engine_serves

    return split_engine_serves(spec)


def _on_peft(cfg: RunConfig, spec: ModelSpec) -> bool:
    """The config's experts run on peft's ParamWrapper (`lora.engine` resolved)."""
    # lazy: heavy to import (torch, peft via moetune.engine)
    from moetune.engine.resolve import resolve_engine

    m = cfg.model
    return wraps(resolve_engine(spec, cfg.lora, m.experts_dtype, m.quantized_base))


def _move_subsets(cfg: RunConfig, spec: ModelSpec) -> Iterator[tuple[Move, ...]]:
    usable = _usable_moves(cfg, spec)
    for n in range(len(usable) + 1):
        yield from itertools.combinations(usable, n)


def _parts(spec: ModelSpec) -> dict[str, bool]:
    """Which model parts the moves that need them find at all."""
    return {
        "dense": bool(spec.dense_layers and spec.dense_intermediate_size),
        "shared": bool(spec.moe_layers and spec.shared_intermediate_size),
        "attention": True,
    }


def _storages(cfg: RunConfig, spec: ModelSpec) -> list[Storage]:
    """Expert storages leaner than the config's (quantised experts train LoRA, not full); a
    published quantised base trains as stored (or dequantised), never re-stored."""
    if not _split_serves(cfg, spec) or published_format(spec):
        return []
    level = LEVEL[cfg.model.experts_dtype]
    leaner = [s for s in STORAGES if LEVEL[s.dtype] > level]
    if cfg.model.experts_dtype == "nf4" and not cfg.model.experts_double_quant:
        leaner.append(Storage("nf4", True, "NF4 double quant (≈ 0.4 bit/param less)"))
    return leaner


def _rank_and_seq_steps(
    cfg: RunConfig, spec: ModelSpec, names: set[str]
) -> Iterator[tuple[int, int, int]]:
    """(whole-rank, expert-rank, sequence) halvings within their floors."""
    expert_rank = cfg.lora.effective_expert_rank
    stacks = spec.is_moe and "experts" in cfg.lora.targets
    explicit = cfg.lora.expert_mapping == "explicit" or "explicit" in names
    for r in _halvings(cfg.lora.rank, MIN_RANK):
        if r and stacks and expert_rank >> r < MIN_EXPERT_RANK:
            break  # halving the whole rank halves the experts' too
        alone = _halvings(expert_rank >> r, MIN_EXPERT_RANK) if stacks and explicit else range(1)
        for e, s in itertools.product(alone, _halvings(cfg.train.seq_len, MIN_SEQ)):
            yield r, e, s


def _halvings(value: int, floor: int) -> range:
    steps = 0
    while value // 2 ** (steps + 1) >= floor:
        steps += 1
    return range(steps + 1)


def _option(
    cfg: RunConfig,
    spec: ModelSpec,
    subset: tuple[Move, ...],
    storage: Storage | None,
    steps: tuple[int, int, int],  # expert-rank, whole-rank and sequence halvings
) -> _Option:
    e, r, s = steps
    moves = {m.name for m in subset}
    cost = sum(m.cost for m in subset)
    if storage is not None:
        moves |= _storage_moves(cfg, spec, storage)
        cost += _storage_cost(cfg, storage)
    # halving twice includes halving once, and halving the whole rank halves the experts'
    # too: a fitting shallower option makes the deeper ones redundant
    stacks = spec.is_moe and "experts" in cfg.lora.targets
    moves |= {f"erank{i}" for i in range(1, e + r + 1)} if stacks else set()
    moves |= {f"rank{i}" for i in range(1, r + 1)} | {f"seq{i}" for i in range(1, s + 1)}
    cost += e * COSTS["expert_rank"] + r * COSTS["rank"] + s * COSTS["seq"]
    return _Option(round(cost, 4), frozenset(moves), subset, storage, e, r, s)


def _storage_moves(cfg: RunConfig, spec: ModelSpec, storage: Storage) -> set[str]:
    """int8 ⊂ nf4 (NF4 has int8's compromise and more), and both include the engine."""
    level = LEVEL[cfg.model.experts_dtype]
    moves = {s.dtype for s in STORAGES if level < LEVEL[s.dtype] <= LEVEL[storage.dtype]}
    if level == LEVEL[storage.dtype]:
        moves.add("dq")
    return moves | ({"engine"} if _on_peft(cfg, spec) else set())


def _storage_cost(cfg: RunConfig, storage: Storage) -> float:
    if cfg.model.experts_dtype == storage.dtype:
        return COSTS["dq"]
    return COSTS[storage.dtype] - COSTS.get(cfg.model.experts_dtype, 0.0)


# ---------------------------------------------------------------- building one


def _build(cfg: RunConfig, spec: ModelSpec, option: _Option) -> _Candidate | None:
    """The config `option` describes, with its changes in words and as `--set` overrides;
    None when the moves do not combine (e.g. quantised experts under full fine-tuning)."""
    new, changes, overrides = cfg, [], []
    for move in option.subset:
        applied = move.apply(new)
        if applied is None:
            return None
        said, override = move.says(new, applied)
        new = applied
        changes.append(said)
        overrides.append(override)
    for step in (
        partial(_with_storage, spec, option.storage),
        partial(_with_ranks, cfg, option.expert_steps, option.rank_steps),
        partial(_with_seq, cfg, option.seq_steps),
    ):
        done = step(new)
        if done is None:
            return None
        new, words, sets = done
        changes += words
        overrides += sets
    return _Candidate(new, option, tuple(changes), _last_per_field(overrides))


def _last_per_field(overrides: list[str]) -> tuple[str, ...]:
    """One `--set` per field (dropping two targets writes lora.targets twice): the last."""
    fields = [o.partition("=")[0] for o in overrides]
    return tuple(o for i, o in enumerate(overrides) if fields[i] not in fields[i + 1 :])


_Step = tuple[RunConfig, list[str], list[str]]  # the config, changes in words, overrides


def _with_storage(spec: ModelSpec, storage: Storage | None, c: RunConfig) -> _Step | None:
    if storage is None:
        return c, [], []
    if not spec.is_moe or c.train.tuning != "lora" or c.train.quantization != "none":
        return None  # quantised frozen experts: LoRA on moetune's engine only
    sets = [] if splits(c.lora.engine) else ["lora.engine=moetune"]
    sets += [f"model.experts_dtype={storage.dtype}"]
    sets += ["model.experts_double_quant=true"] if storage.double_quant else []
    c = restored(c, storage)  # as the --set say
    return c, [f"{storage.words} on engine moetune"], sets


def _with_ranks(cfg: RunConfig, e: int, r: int, c: RunConfig) -> _Step | None:
    if not (e or r):
        return c, [], []
    if c.train.tuning == "full" or (e and c.lora.expert_mapping != "explicit"):
        return None  # lora.expert_rank needs explicit expert targets
    words, sets = [], []
    if r:
        words.append(f"rank {cfg.lora.rank} → {cfg.lora.rank >> r}")
        sets.append(f"lora.rank={cfg.lora.rank >> r}")
        c = with_lora(c, rank=cfg.lora.rank >> r)
    if e or (r and cfg.lora.expert_rank is not None):
        old, rank = cfg.lora.effective_expert_rank, cfg.lora.effective_expert_rank >> (e + r)
        keeps = "keeps" if c.lora.rank == cfg.lora.rank else "gets"
        words.append(f"expert rank {old} → {rank} (attention {keeps} rank {c.lora.rank})")
        sets.append(f"lora.expert_rank={rank}")
        c = with_lora(c, expert_rank=rank)
    return c, words, sets


def _with_seq(cfg: RunConfig, s: int, c: RunConfig) -> _Step:
    if not s:
        return c, [], []
    seq = cfg.train.seq_len >> s
    words = [f"sequence length {cfg.train.seq_len} → {seq}"]
    return with_train(c, seq_len=seq), words, [f"train.seq_len={seq}"]


# ---------------------------------------------------------------- the search


def recommend(spec: ModelSpec, cfg: RunConfig, cards: list[Card]) -> list[Recommendation]:
    """Up to RECS_PER_CARD cheapest fitting changes for each card in `cards`; a card no
    searched change fits gets one `fits=False` entry that says why."""
    if not cards:
        return []
    search = _Search(spec, cfg)
    leanest = search.leanest()
    lean = analytic(spec, leanest.cfg if leanest else cfg)
    reachable = [c for c in cards if leanest and card_fit(c, lean.peak_bytes).fits]
    found = search.run(reachable)
    out = [r for c in reachable for r in found[c.id]]
    for card in reachable:  # the search stopped at MAX_CANDIDATES before one fitted
        if not found[card.id] and leanest is not None:
            rec = _fitting(card, leanest, lean.peak_bytes)
            out += [replace(rec, notes=(*rec.notes, _CAPPED))] if rec else []
    stuck = [c for c in cards if c not in reachable]
    out += [
        _offloaded(spec, cfg, c, leanest) or _no_fit(spec, cfg, c, leanest, lean) for c in stuck
    ]
    return sorted(out, key=lambda r: (not r.fits, r.cost, r.card))


_CAPPED = f"the search stopped after {MAX_CANDIDATES} re-plans: a cheaper change may fit"


# moves that never add memory, whatever else changes: an option with all of them (and the
# leanest expert storage) bounds every option that differs only in these from below
_NEVER_MORE = ("engine", "as_stored", "gc", "batch", "full→lora")


class _Search:
    """Options cheapest first, each re-planned at most once (`MAX_CANDIDATES` in all) and
    only for the cards it could still give a new, non-redundant recommendation.

    Pruning relies on the peak never growing when a memory-saving change is added: an
    option whose lean completion (`_completion`) does not fit a card cannot fit it.
    """

    def __init__(self, spec: ModelSpec, cfg: RunConfig) -> None:
        self.spec, self.cfg = spec, cfg
        self.options = _options(cfg, spec)
        self.planned: dict[frozenset[str], tuple[_Candidate, int] | None] = {}
        usable = {m.name for m in _usable_moves(cfg, spec)}
        self.lean_moves = tuple(m for m in MOVES if m.name in _NEVER_MORE and m.name in usable)
        storages = _storages(cfg, spec)
        self.lean_storage = storages[-1] if storages else None

    def peak(self, option: _Option) -> tuple[_Candidate, int] | None:
        """The option's config and analytic peak; None when its moves do not combine."""
        if option.moves not in self.planned:
            if len(self.planned) >= MAX_CANDIDATES:
                return None
            cand = _build(self.cfg, self.spec, option)
            peak = analytic(self.spec, cand.cfg).peak_bytes if cand else 0
            self.planned[option.moves] = (cand, peak) if cand else None
        return self.planned[option.moves]

    def leanest(self) -> _Candidate | None:
        """Every memory-saving change at once: if it does not fit, nothing searched does."""
        by_size = sorted(self.options, key=lambda o: (len(o.moves), o.cost), reverse=True)
        built = (_build(self.cfg, self.spec, o) for o in by_size)
        return next((c for c in built if c is not None), None)

    def run(self, cards: list[Card]) -> dict[str, list[Recommendation]]:
        found: dict[str, list[Recommendation]] = {c.id: [] for c in cards}
        seen: dict[str, list[frozenset[str]]] = {c.id: [] for c in cards}
        for option in self.options:
            room = [c for c in cards if _open(found[c.id], option.cost)]
            if not room or len(self.planned) >= MAX_CANDIDATES:
                break
            todo = [c for c in room if not any(prev <= option.moves for prev in seen[c.id])]
            todo = self._could_fit(option, todo)
            planned = self.peak(option) if todo else None
            if planned is None:
                continue
            for card in todo:
                rec = _fitting(card, *planned)
                if rec is not None:
                    seen[card.id].append(option.moves)
                    found[card.id].append(rec)
        return found

    def _could_fit(self, option: _Option, cards: list[Card]) -> list[Card]:
        """The cards the option's lean completion fits (the others it cannot)."""
        if not cards:
            return cards
        bound = self.peak(self._completion(option))
        return cards if bound is None else [c for c in cards if card_fit(c, bound[1]).fits]

    def _completion(self, option: _Option) -> _Option:
        names = {m.name for m in option.subset} | {m.name for m in self.lean_moves}
        storage = self.lean_storage or option.storage
        if storage is not None:
            names.discard("engine")  # the storage sets it
        subset = tuple(m for m in MOVES if m.name in names)
        steps = (option.expert_steps, option.rank_steps, option.seq_steps)
        return _option(self.cfg, self.spec, subset, storage, steps)


def _open(found: list[Recommendation], cost: float) -> bool:
    """Whether a card still takes recommendations at `cost` (options come cheapest first)."""
    if not found:
        return True
    return len(found) < RECS_PER_CARD and cost <= found[0].cost + ALTERNATIVES_WITHIN + 1e-9


def _fitting(card: Card, cand: _Candidate, peak: int) -> Recommendation | None:
    fit = card_fit(card, peak)
    if not fit.fits:
        return None
    notes = ("experts kept (never dropped)",) if "attention" in cand.option.moves else ()
    return Recommendation(
        card.id, cand.changes, cand.overrides, round(cand.option.cost, 2), peak,
        fit.required_bytes, fit.headroom_bytes, notes,
    )  # fmt: skip


def _offloaded(
    spec: ModelSpec, cfg: RunConfig, card: Card, leanest: _Candidate | None
) -> Recommendation | None:
    """Nothing searched fits: the frozen experts streamed through host RAM or from disk –
    a speed cost, no quality cost – as configured, else after the changes that cost no
    quality beyond speed (`_NEVER_MORE`), else after the leanest changes."""
    bases = [cfg, _speed_only(spec, cfg), leanest]
    for base in bases:
        base_cfg = base if isinstance(base, RunConfig) else base.cfg if base else None
        plan = fitting_offload(spec, base_cfg, card) if base_cfg is not None else None
        if plan is None:
            continue
        if isinstance(base, _Candidate):
            cost = round(base.option.cost, 2)
            return offload_recommendation(plan, cost, base.changes, base.overrides)
        return offload_recommendation(plan, 0.0, (), ())
    return None


def _speed_only(spec: ModelSpec, cfg: RunConfig) -> _Candidate | None:
    """`cfg` with every usable change that costs speed only (checkpointing, batch 1, …)."""
    usable = {m.name for m in _usable_moves(cfg, spec)}
    subset = tuple(m for m in MOVES if m.name in _NEVER_MORE and m.name in usable)
    return _build(cfg, spec, _option(cfg, spec, subset, None, (0, 0, 0))) if subset else None


def _no_fit(
    spec: ModelSpec, cfg: RunConfig, card: Card, leanest: _Candidate | None, est: AnalyticEstimate
) -> Recommendation:
    """No searched change fits: how far the leanest one (`est`) is, and what is left."""
    lean_cfg = leanest.cfg if leanest else cfg
    fit = card_fit(card, est.peak_bytes)
    frozen = est.components.get("frozen_weights") or est.components["trainable_weights"]
    stored = held_as(spec, lean_cfg)
    offload = (
        "unified memory: offloading frees nothing" if card.host_link is None
        else "offloading the frozen experts does not fit either"
    )  # fmt: skip
    why = (
        f"the frozen weights alone ({frozen / GiB:.0f} GiB, {stored}) exceed the card"
        if not card_fit(card, frozen).fits
        else f"even the leanest searched config is {-fit.headroom_bytes / GiB:.1f} GiB short"
    )
    return Recommendation(
        card.id, leanest.changes if leanest else (), leanest.overrides if leanest else (),
        round(leanest.option.cost, 2) if leanest else 0.0, est.peak_bytes,
        fit.required_bytes, fit.headroom_bytes,
        (f"{why}; experts were not dropped (that would not train the MoE) – use a larger "
         f"card or several GPUs ({offload})",),
        fits=False,
    )  # fmt: skip
