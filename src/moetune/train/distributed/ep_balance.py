"""`train.ep_placement: balanced` in a run: the experts placed from the base's routing that
the trainer measures on the training rows before the first step (train/routing/recorder.py,
`RoutingState.measured_base`; every ep rank runs the same rows, so all agree), through
engine/ep_placement.py. The placement is kept in the run dir (ep_placement.json) and a
resume places the experts the same way: the checkpoint holds the adapter and the optimizer
state whole in the base's order, so it does not depend on the placement, but the same
placement keeps every rank's rows – and so the float rounding – those of the run it resumes.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from moetune.io import atomic_write_json
from moetune.model.families.registry import get_family
from moetune.model.layers import decoder_layers
from moetune.train.errors import TrainError

if TYPE_CHECKING:
    from torch import nn

    from moetune.config import RunConfig
    from moetune.train.routing.recorder import LayerLoad
    from moetune.train.rundir.checkpoint import RunDir
    from moetune.train.setup import Setup

FILE = "ep_placement.json"  # in the run dir


def balance_experts(
    cfg: RunConfig, setup: Setup, run: RunDir, model: nn.Module, base: dict[int, LayerLoad]
) -> dict[str, Any] | None:
    """Place each MoE layer's experts by its measured load; the figures ep_placement.json
    keeps (each layer's order, its rows per rank contiguous and balanced)."""
    if cfg.train.ep_placement != "balanced" or setup.args.world_size == 1:
        return None
    # lazy: heavy to import (moetune's engine pulls transformers)
    from moetune.engine.ep_placement import balanced_groups, place, rank_loads, shard_of

    modules = _placed_modules(model, setup)
    ranks = shard_of(next(iter(modules.values()))).ranks  # type: ignore[union-attr]
    path = run.root / FILE
    if setup.resume_from and path.is_file():  # the same rows per rank as before the stop
        orders = {int(k): v for k, v in json.loads(path.read_text())["orders"].items()}
    else:
        missing = sorted(set(modules) - set(base))
        if missing:
            raise TrainError(f"train.ep_placement balanced read no routing for MoE layers "
                             f"{missing}", "set train.ep_placement: contiguous")  # fmt: skip
        orders = {i: _order(balanced_groups(base[i].counts, ranks)) for i in modules}
    for layer, experts in modules.items():
        place(experts, orders[layer])
    figures = {"orders": {str(i): o for i, o in orders.items()}, "rows_per_rank": {
        str(i): {"contiguous": rank_loads(base[i].counts, range(len(o)), ranks),
                 "balanced": rank_loads(base[i].counts, o, ranks)}
        for i, o in orders.items() if i in base}}  # fmt: skip
    if setup.args.should_save:
        atomic_write_json(path, figures)
    return figures


def _order(groups: list[list[int]]) -> list[int]:
    """The groups end to end: rank r's experts at positions r·E/N … (r+1)·E/N − 1."""
    return [expert for group in groups for expert in group]


def _placed_modules(model: nn.Module, setup: Setup) -> dict[int, nn.Module]:
    """MoE layer -> its experts module as shard_experts placed it."""
    # lazy: heavy to import (moetune's engine pulls transformers)
    from moetune.engine.ep_placement import shard_of

    layers = decoder_layers(model, setup.spec, get_family(setup.spec.model_type))
    found = {}
    for i in setup.spec.moe_layers:
        placed = [m for m in layers[i].modules() if shard_of(m) is not None]
        if placed:
            found[i] = placed[0]
    if not found:
        raise TrainError("train.ep_placement balanced found no experts placed by ep",
                         "set train.ep_placement: contiguous")  # fmt: skip
    return found
