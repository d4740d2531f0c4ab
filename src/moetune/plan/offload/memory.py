"""The offload plan (`train.offload: cpu | disk`): what stays on the device, what waits in
host RAM or on disk, the bytes a step moves, and the step time they allow.

What moves: the routed expert stacks of every MoE layer – frozen, and most of an MoE's
bytes (as stored: int8 / NF4 stacks move their quantised bytes, a base kept as published
its checkpoint's bytes, dequantised one expert at a time on the device). Everything else
stays on the device: attention, routers, shared experts, embeddings, the LM head, LoRA
factors, their gradients and the optimizer state. A layer's stacks reach the device just before
it runs, the next layer's prefetched meanwhile, so the device holds two layers of them.

Per step (one optimizer step: `grad_accum` micro-batches) each micro-batch reads every
MoE layer's stacks in the forward, again in the recompute when gradient checkpointing is
on, and again in the backward (the input gradient needs the weights). The copies overlap
the compute (prefetch), so the step takes max(compute, transfer); `balance_tokens` are the
tokens per step at which the two are equal – below it the step is transfer-bound.

The device is host RAM itself – the CPU card, this host (`plan.host`) – when no card is
named or `train.device` is cpu; the device peak is then the process's expected peak RSS
(everything resident at the compute dtype – fp32 unless train.precision is bf16, as train
loads it –, two layers of streamed stacks, the step's tensors and `CPU_PROCESS_BASELINE`),
checked against the RAM available, and the step time comes from the host's measured
rates (`plan.offload.cpu_step`). Disk offload assumes the engine drops a layer's mapped file pages
once copied, so they are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moetune.config import RunConfig
from moetune.config.keys import offload_mode, streaming_modes
from moetune.errors import ConfigError, MoetuneError
from moetune.model.spec import ModelSpec
from moetune.plan.analytic import QUANT_BYTES, expert_bytes_per_param
from moetune.plan.cost.estimate import MFU, flops_per_token
from moetune.plan.fit import Recommendation, analytic
from moetune.plan.hardware import Card, HostLink, all_cards, disk_read_bytes_per_s, get_card
from moetune.plan.host import CPU_CARD, UNCALIBRATED, as_run_on, cpu_card, has_cuda, ram
from moetune.plan.offload.cpu_step import STREAM_EFFICIENCY, cpu_step
from moetune.plan.overhead import CPU_PROCESS_BASELINE, card_overhead
from moetune.plan.step import DTYPE_BYTES, Step

MiB = 1024**2
GiB = 1024**3
STREAMED_LAYERS = 2  # the layer running and the one prefetched
# Assumed, not measured here: a CUDA process's host side (CUDA runtime, cuBLAS / cuDNN
# host code, torch, transformers, the trainer) beside its pinned buffers.
CUDA_HOST_BASELINE = 3 * GiB


@dataclass(frozen=True)
class OffloadPlan:
    """`moetune plan --offload`: bytes by place, bytes moved, and the time they take."""

    offload: str  # "cpu" | "disk"
    card: str  # "cpu": the device is this host's RAM
    device_peak_bytes: int
    device_components: dict[str, int]
    pinned_host_bytes: int  # cpu: the offloaded stacks; disk: the staging buffers
    host_ram_bytes: int  # all host RAM the run needs
    host_ram_available_bytes: int
    disk_bytes: int  # disk: the offloaded stacks' file bytes read each pass
    offloaded_bytes: int  # every MoE layer's routed stacks, as stored
    layer_expert_bytes: int  # one MoE layer's routed stacks, as stored
    bytes_moved_per_step: dict[str, int]  # forward / recompute / backward
    host_link: HostLink
    transfer_bytes_per_s: float  # the slower of the link and (disk) the disk read
    tokens_per_step: int
    compute_s: float
    transfer_s: float
    balance_tokens: int
    usable_bytes: int | None = None  # the card's (CPU: the RAM available now)
    notes: tuple[str, ...] = ()
    overlapped_s: float | None = None  # CPU: Σ max(read, compute) per layer (plan.offload.cpu_step)

    @property
    def step_time_s(self) -> float:
        if self.overlapped_s is not None:
            return self.overlapped_s
        return max(self.compute_s, self.transfer_s)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s if self.step_time_s else 0.0

    @property
    def fits(self) -> bool | None:
        """The device peak within the card's usable memory (CPU: the process's RSS within
        the RAM available; None: no figure)."""
        return None if self.usable_bytes is None else self.device_peak_bytes <= self.usable_bytes

    @property
    def host_ram_fits(self) -> bool:
        return self.host_ram_bytes <= self.host_ram_available_bytes

    @property
    def bound(self) -> str:
        return "transfer" if self.transfer_s > self.compute_s else "compute"

    def to_json(self) -> dict[str, Any]:
        return {
            "offload": self.offload,
            "card": self.card,
            "device_peak_bytes": self.device_peak_bytes,
            "device_components": dict(self.device_components),
            "usable_bytes": self.usable_bytes,
            "fits": self.fits,
            "pinned_host_bytes": self.pinned_host_bytes,
            "host_ram_bytes": self.host_ram_bytes,
            "host_ram_available_bytes": self.host_ram_available_bytes,
            "host_ram_fits": self.host_ram_fits,
            "disk_bytes": self.disk_bytes,
            "offloaded_bytes": self.offloaded_bytes,
            "layer_expert_bytes": self.layer_expert_bytes,
            "bytes_moved_per_step": dict(self.bytes_moved_per_step),
            "host_link": self.host_link.to_json(),
            "transfer_bytes_per_s": self.transfer_bytes_per_s,
            "tokens_per_step": self.tokens_per_step,
            "compute_s": self.compute_s,
            "transfer_s": self.transfer_s,
            "step_time_s": self.step_time_s,
            "bound": self.bound,
            "balance_tokens": self.balance_tokens,
            "tokens_per_s": self.tokens_per_s,
            "notes": list(self.notes),
        }


def plan_offload(spec: ModelSpec, cfg: RunConfig, card: Card | str | None = None) -> OffloadPlan:
    """The offload plan of `cfg` (train.offload cpu or disk) on `card` (None: this host)."""
    chosen = _device(cfg, card)
    cfg = as_run_on(cfg, chosen)
    layer = layer_expert_bytes(spec, cfg)
    n_moe = len(spec.moe_layers)
    file_layer = file_layer_bytes(spec, cfg, layer)
    components = _device_components(spec, cfg, chosen, layer * n_moe, layer)
    peak = sum(components.values())
    moved = bytes_moved(spec, cfg, file_layer)
    rate = _transfer_rate(cfg, chosen)
    tokens = cfg.train.seq_len * cfg.train.batch_size * cfg.train.grad_accum
    compute, transfer, overlapped = _times(
        spec, cfg, chosen, file_layer, layer, sum(moved.values()) / rate
    )
    return OffloadPlan(
        offload=cfg.train.offload,
        card=chosen.id,
        device_peak_bytes=peak,
        device_components=components,
        offloaded_bytes=layer * n_moe,
        layer_expert_bytes=layer,
        bytes_moved_per_step=moved,
        host_link=_link(chosen),
        transfer_bytes_per_s=rate,
        tokens_per_step=tokens,
        compute_s=compute,
        transfer_s=transfer,
        overlapped_s=overlapped,
        balance_tokens=round(transfer / compute * tokens),
        usable_bytes=chosen.usable_bytes,
        notes=_notes(cfg, chosen),
        **_host(cfg, chosen, file_layer * n_moe, layer, peak),
    )


def _times(
    spec: ModelSpec, cfg: RunConfig, card: Card, file_layer: int, layer: int, transfer: float
) -> tuple[float, float, float | None]:
    """(compute s, transfer s, the overlapped step s: CPU only) of one optimizer step."""
    if card.is_host:
        step = cpu_step(spec, cfg, card, file_layer, layer)
        return step.cpu_s, step.read_s, step.step_s
    tokens = cfg.train.seq_len * cfg.train.batch_size * cfg.train.grad_accum
    per_token = flops_per_token(spec.active_params, cfg.train.gradient_checkpointing)
    if not card.tensor_tflops:  # a card given by its memory: compute untimed (its note says)
        return 0.0, transfer, None
    return tokens * per_token / (card.tensor_tflops * 1e12 * MFU), transfer, None


def _device(cfg: RunConfig, card: Card | str | None) -> Card:
    """The card the plan is for (this host's CPU card when none is named or train.device
    is cpu), refusing what cannot work."""
    offload = cfg.train.offload
    if not offload_mode(offload).streams:
        raise ConfigError(
            f"train.offload is {offload!r}: there is no offload to plan",
            "set train.offload: cpu or disk (or pass --offload cpu|disk)",
        )
    if cfg.train.tuning == "full":
        raise ConfigError(
            "train.offload moves frozen expert stacks, and full fine-tuning freezes none",
            "set train.tuning: lora to offload the frozen experts",
        )
    if cfg.model.is_gguf:
        raise ConfigError(
            "train.offload on a GGUF base: a .gguf cannot be trained, nor streamed",
            "point model.id at the safetensors checkpoint of the same model",
        )
    chosen = get_card(card) if isinstance(card, str) else card
    if chosen is None or cfg.train.device == "cpu":
        return cpu_card()
    if chosen.host_link is None:
        raise ConfigError(
            f"{chosen.id} is unified memory: host RAM and the device are one pool, so "
            "offloading frees nothing",
            "set train.offload: none there, or plan a card with its own memory",
        )
    return chosen


def layer_expert_bytes(spec: ModelSpec, cfg: RunConfig) -> int:
    """One MoE layer's routed expert stacks as the run stores them (int8 / NF4 or a base
    kept as published: quantised; bitsandbytes runs: fp32, which
    prepare_model_for_kbit_training upcasts them to)."""
    if not spec.moe_layers or not spec.components.routed_experts:
        raise ConfigError(
            f"{spec.name} has no routed experts: train.offload streams expert stacks",
            "set train.offload: none for a dense model",
        )
    step = Step.from_config(cfg, spec)
    per_param = 4.0 if step.quantization in QUANT_BYTES else expert_bytes_per_param(spec, step)
    return round(spec.components.routed_experts / len(spec.moe_layers) * per_param)


def file_layer_bytes(spec: ModelSpec, cfg: RunConfig, layer: int) -> int:
    """One layer's stacks as each fetch moves them: disk offload reads a float stack in the
    checkpoint's own dtype (bf16 files widened to fp32 after the read move 2 bytes a
    parameter, not 4); quantised stacks and host copies move as stored."""
    step = Step.from_config(cfg, spec)
    quantised = step.quantization in QUANT_BYTES or step.experts_quantised
    if not offload_mode(cfg.train.offload).on_disk or quantised:
        return layer
    file_bytes = DTYPE_BYTES.get(spec.dtype, step.weight_bytes)
    return round(spec.components.routed_experts / len(spec.moe_layers) * file_bytes)


def bytes_moved(spec: ModelSpec, cfg: RunConfig, layer: int) -> dict[str, int]:
    """Bytes copied to the device per optimizer step, by pass."""
    one_pass = layer * len(spec.moe_layers) * cfg.train.grad_accum
    recompute = one_pass if cfg.train.gradient_checkpointing else 0
    return {"forward": one_pass, "recompute": recompute, "backward": one_pass}


def _device_components(
    spec: ModelSpec, cfg: RunConfig, card: Card, offloaded: int, layer: int
) -> dict[str, int]:
    """The analytic peak with the frozen weights split into what stays and what streams
    (the frozen bytes are live in every phase, so the peak phase does not change)."""
    est = analytic(spec, cfg)
    parts = dict(est.components)
    frozen = parts.pop("frozen_weights", 0)
    resident = frozen - offloaded
    if card.is_host and offload_mode(cfg.train.offload).in_host_ram:
        resident = frozen  # host RAM is the device: the offloaded stacks live there too
    out = {
        "resident_weights": resident,
        "streamed_experts": STREAMED_LAYERS * layer,
        "lora": parts.pop("trainable_weights", 0),
        **parts,
    }
    if card.is_host:
        return {**out, "process_baseline": CPU_PROCESS_BASELINE}
    return {**out, "overhead": card_overhead(card, sum(out.values())).total}


def _host(
    cfg: RunConfig, card: Card, offloaded: int, layer: int, device_peak: int
) -> dict[str, int]:
    """Pinned host bytes, all host RAM the run needs, what the host has, disk read."""
    mode = offload_mode(cfg.train.offload)
    disk = offloaded if mode.on_disk else 0
    if card.is_host:  # one memory: the device peak is the process
        pinned = offloaded if mode.in_host_ram else 0
        need = device_peak
    else:
        pinned = offloaded if mode.in_host_ram else STREAMED_LAYERS * layer
        need = pinned + CUDA_HOST_BASELINE
    return {
        "pinned_host_bytes": pinned,
        "host_ram_bytes": need,
        "host_ram_available_bytes": host_ram_available(cfg, card),
        "disk_bytes": disk,
    }


def host_ram_available(cfg: RunConfig, card: Card | None) -> int:
    """hardware.host_ram_gb, else the card's usual node (the CPU card: this host's RAM),
    else this machine's RAM."""
    if cfg.hardware.host_ram_gb:
        return int(cfg.hardware.host_ram_gb * 1e9)
    return (card.host_ram_bytes if card else None) or ram()[0]


def _link(card: Card) -> HostLink:
    assert card.host_link is not None, "_device refuses cards without a host link"
    return card.host_link


def _transfer_rate(cfg: RunConfig, card: Card) -> float:
    """What the stream reads at: the link, and with disk offload the slower of it and the
    disk (a CPU card: its measured disk rate × STREAM_EFFICIENCY; offload cpu on a CPU
    crosses no link, so its memcpy rate stands)."""
    link = _link(card).bytes_per_s
    if not offload_mode(cfg.train.offload).on_disk:
        return link
    if card.rates is not None:
        return card.rates.disk_read_gb_per_s * 1e9 * STREAM_EFFICIENCY
    return min(link, disk_read_bytes_per_s())


def _notes(cfg: RunConfig, card: Card) -> tuple[str, ...]:
    notes = [
        "offloaded: every MoE layer's routed expert stacks (frozen); the rest stays resident",
        *(_cpu_notes(cfg, card) if card.is_host else _gpu_notes(cfg, card)),
    ]
    return tuple(notes)


def _gpu_notes(cfg: RunConfig, card: Card) -> list[str]:
    notes = [
        f"compute at MFU {MFU} of the card's {card.compute_dtype} peak (plan.estimate); host "
        f"side {CUDA_HOST_BASELINE // GiB} GiB beside the pinned buffers (assumed)",
        *([f"{card.assumed}: the step time is the transfer alone"] if card.assumed else []),
    ]
    if offload_mode(cfg.train.offload).on_disk:
        notes.append(
            f"disk read {disk_read_bytes_per_s() / 1e9:g} GB/s assumed (one NVMe); mapped file "
            "pages are dropped after each layer's copy, so the OS page cache is not counted"
        )
    return notes


def _cpu_notes(cfg: RunConfig, card: Card) -> list[str]:
    rates = card.rates
    assert rates is not None, "a CPU card carries its rates"
    where = f"measured ({rates.source})" if rates.calibrated else UNCALIBRATED
    notes = [
        f"the device is this host's RAM: the peak is the process's RSS (compute dtype, "
        f"{CPU_PROCESS_BASELINE // MiB} MiB process baseline, measured), fit against the RAM "
        f"available now; matmul {rates.gflops(4):.1f} / {rates.gflops(2):.1f} GFLOP/s fp32 / "
        f"bf16, memcpy {rates.memcpy_gb_per_s:.2f} GB/s – {where}"
    ]
    if offload_mode(cfg.train.offload).on_disk:
        notes.append(
            f"disk read {rates.disk_read_gb_per_s:.2f} GB/s × {STREAM_EFFICIENCY} (the reader's "
            "share of O_DIRECT, assumed); the step is Σ max(read, compute) per layer and phase"
        )
    return notes


def with_offload(cfg: RunConfig, offload: str) -> RunConfig:
    """`cfg` with train.offload set (the recommendation search and the CLI use it)."""
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"offload": offload})})


def offload_plans(
    spec: ModelSpec, cfg: RunConfig, cards: list[str] | None
) -> dict[str, OffloadPlan]:
    """`plan --offload`: per card with a host link (unified-memory cards have nothing to
    offload to: when they are all there is, that refusal), or one plan keyed "cpu" – this
    host – when train.device is cpu, or no card is named (`cards` None) and no CUDA
    device is here."""
    if cfg.train.device == "cpu" or (cards is None and not has_cuda()):
        return {CPU_CARD: plan_offload(spec, cfg, None)}
    chosen = [get_card(c) for c in cards] if cards is not None else all_cards()
    linked = [c for c in chosen if c.host_link is not None] or chosen[:1]
    return {c.id: plan_offload(spec, cfg, c) for c in linked}


def fitting_offload(spec: ModelSpec, cfg: RunConfig, card: Card) -> OffloadPlan | None:
    """The offload that fits `card`: the configured one, else cpu when the host holds the
    stacks, else disk; None when none fits (or offload cannot apply: dense, full
    fine-tuning, unified memory)."""
    asked = cfg.train.offload
    kinds = (asked,) if offload_mode(asked).streams else streaming_modes()
    try:
        plans = [plan_offload(spec, with_offload(cfg, o), card) for o in kinds]
    except MoetuneError:
        return None
    return next((p for p in plans if p.fits and p.host_ram_fits), None)


def offload_recommendation(
    plan: OffloadPlan, cost: float, changes: tuple[str, ...], overrides: tuple[str, ...]
) -> Recommendation:
    """`plan` as a recommendation after `changes`: a speed cost, no quality cost."""
    where = offload_mode(plan.offload).where
    words = (
        f"offload the frozen experts to {where} (train.offload: {plan.offload}; same "
        f"result, ≈ {plan.tokens_per_s:,.0f} tok/s, {plan.bound}-bound)"
    )
    usable = plan.usable_bytes or 0
    overhead = plan.device_components.get("overhead", 0)
    return Recommendation(
        str(plan.card), (*changes, words), (*overrides, f"train.offload={plan.offload}"),
        cost, plan.device_peak_bytes - overhead, plan.device_peak_bytes,
        usable - plan.device_peak_bytes,
        (f"nothing else searched fits; host RAM {plan.host_ram_bytes / GiB:.0f} GiB of "
         f"{plan.host_ram_available_bytes / GiB:.0f}",),
        tokens_per_s=plan.tokens_per_s,
    )  # fmt: skip
