"""Generation under `train.strategy ep` (GRPO's rollouts): every rank steps together.

With the experts placed E/N a rank, each decoding step's forward is a collective – every
MoE layer exchanges tokens with `all_to_all_single` over all ranks. Ranks sample their own
prompts, so one may draw its end-of-sequence tokens (or reach max_new_tokens) while another
is still generating; a rank that left the decoding loop would leave the others waiting in
their next exchange until the collective timeout.

transformers' `generate` has the answer ZeRO-3 and FSDP use: `synced_gpus=True` all-reduces
a "finished" flag at every step and keeps a finished rank running the forward (its outputs
discarded, nothing appended) until every rank has finished – so every rank runs the same
number of forward calls. transformers turns it on by itself only for DeepSpeed ZeRO-3 and
FSDP-managed modules; an ep model gets it here, on its `generate`, whatever the caller
passes (TRL's GRPOTrainer passes none).
"""

from __future__ import annotations

import functools
from typing import Any

SYNCED = "_moetune_ep_synced_generate"  # on the base model: its generate is synced


def sync_generation(model: Any) -> Any:
    """Make `model`'s generate (a peft model's base: the transformers model under it) step
    every rank together; returns the transformers model. Idempotent."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    if base.__dict__.get(SYNCED):
        return base
    plain = base.generate  # the class's bound method

    @functools.wraps(plain)
    def generate(*args: Any, **kwargs: Any) -> Any:
        kwargs["synced_gpus"] = True  # never off: a rank leaving early stalls the others
        return plain(*args, **kwargs)

    base.__dict__["generate"] = generate  # the instance's: peft's generate reaches it
    base.__dict__[SYNCED] = True
    return base
