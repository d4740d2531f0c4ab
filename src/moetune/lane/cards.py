"""Which card a launch rents: the cheapest the plan says fits *with room to spare*.

The planner's bytes have not been checked against a CUDA run on every card, so a plan that
fits by 1 GiB on an 80 GB card is a guess that costs a pod when it is wrong. Until a ledger
row measured this step (same signature) on a card, that card must keep `MIN_HEADROOM` of
its usable memory free; `--accept-thin-margin` takes the thin one anyway (and the launch's
ledger rows say so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moetune.config import RunConfig
from moetune.lane.providers import provider_class
from moetune.lane.providers.base import LaneError
from moetune.plan.hardware import all_cards, get_card

MIN_HEADROOM = 0.08  # of the card's usable memory; ~6 GiB on an 80 GB card


@dataclass(frozen=True)
class CardChoice:
    """The card taken, and the cheapest fitting card with and without the margin."""

    card: Any | None  # a plan.hardware.Card, or None (this machine / nothing fits)
    with_margin: str | None
    without_margin: str | None
    accept_thin_margin: bool
    why: str
    thin_only: bool = False  # a card fits, but none with the margin: launching is refused

    def to_json(self) -> dict[str, Any]:
        return {
            "card": getattr(self.card, "id", None),
            "with_margin": self.with_margin,
            "without_margin": self.without_margin,
            "min_headroom_fraction": MIN_HEADROOM,
            "accept_thin_margin": self.accept_thin_margin,
            "why": self.why,
        }

    def require(self) -> None:
        """LaneError when only a thin-margin card fits and the user did not accept it."""
        if self.thin_only:
            raise LaneError(
                f"only {self.without_margin} fits, with under {MIN_HEADROOM:.0%} headroom "
                "that no measured run on it backs",
                "pass --accept-thin-margin to take it, or set hardware.card to a larger card",
            )


def roomy(fit: Any, measured: bool) -> bool:
    """Whether a card's fit keeps the margin (or a measured run on it makes it moot)."""
    return bool(fit.fits) and (measured or fit.headroom_bytes >= MIN_HEADROOM * fit.usable_bytes)


def _cheapest(cards: list[Any]) -> Any | None:
    return min(cards, key=lambda c: c.usd_per_hour or 0.0, default=None)


def choose_card(
    cfg: RunConfig, plan: Any, measured: set[str], accept_thin_margin: bool = False
) -> CardChoice:
    """hardware.card, else the cheapest rentable card that fits with the margin (cards in
    `measured` need none) – or, accepted, without it."""
    fits = getattr(plan, "fits", {}) or {}
    rentable = [c for c in all_cards() if c.runpod_gpu_type_id and c.usd_per_hour]
    fitting = [c for c in rentable if c.id in fits and fits[c.id].fits]
    thin = _cheapest(fitting)
    wide = _cheapest([c for c in fitting if roomy(fits[c.id], c.id in measured)])
    ids = getattr(wide, "id", None), getattr(thin, "id", None)
    if cfg.hardware.card:
        return CardChoice(get_card(cfg.hardware.card), *ids, accept_thin_margin, "hardware.card")
    if not provider_class(cfg.lane.provider).remote or plan is None:
        return CardChoice(None, *ids, accept_thin_margin, "this machine")
    if accept_thin_margin and thin is not None:
        return CardChoice(thin, *ids, True, "cheapest that fits (--accept-thin-margin)")
    if wide is not None:
        why = f"cheapest that fits with ≥ {MIN_HEADROOM:.0%} headroom (or a measured run)"
        return CardChoice(wide, *ids, accept_thin_margin, why)
    why = "no card fits with the margin" if thin else "no rentable card fits"
    return CardChoice(None, *ids, accept_thin_margin, why, thin_only=thin is not None)
