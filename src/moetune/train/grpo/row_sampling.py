"""GRPO's sampling, one random stream per completion: the same completions on any number
of ranks.

transformers' `generate` samples each decoding step with one `torch.multinomial` over the
whole batch, from the process's global generator (TRL seeds it per process:
`set_seed(seed, device_specific=True)`). A completion's tokens then depend on the rank that
drew it and on the rows before it in that rank's batch: 2 ranks of 4 prompts sample other
completions than one process of 8, so the adapter differs – by far more than rounding.

Here each completion draws from its own `torch.Generator`, seeded from (train.seed, the
optimizer step, its row in the global generation batch). Rank r's row i of n is global row
r·n + i: accelerate hands rank r the r-th of every N consecutive batches, so one process
with N times the batch holds that row there. `RowSampler` runs last in generate's logits
chain – after temperature, top-k, top-p, the distribution generate itself would sample –
draws each row's token with the row's generator and hands generate a distribution with all
its mass on that token, so generate's own multinomial can pick only it.

A `logits_processor=` passed to generate is merged in *before* those warpers, so the
sampler is appended, for one call, to the chain the model builds
(`_get_logits_processor`, transformers' own builder). Should a transformers release build
its chain elsewhere, the sampler sees no decoding step and the rollout is refused: never a
silent fall-back to the per-process stream.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import LogitsProcessor

from moetune.train.errors import TrainError

_CHAIN = "_get_logits_processor"  # transformers' GenerationMixin: builds the logits chain


def row_seed(seed: int, step: int, row: int) -> int:
    """A 63-bit seed for one completion: distinct per (seed, step, row), any platform."""
    digest = hashlib.blake2b(f"{seed}/{step}/{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class RowSampler(LogitsProcessor):
    """The sampling of one generate call over `rows` rows, global rows `first`…: each row's
    token drawn from the chain's final scores with that row's own generator."""

    def __init__(self, seed: int, step: int, first: int, rows: int) -> None:
        self.keys = [row_seed(seed, step, first + i) for i in range(rows)]
        self.generators: list[torch.Generator] = []
        self.steps = 0  # decoding steps sampled: 0 after a call means it was bypassed

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> Any:
        if scores.shape[0] != len(self.keys):
            raise TrainError(
                f"generate sampled {scores.shape[0]} rows from {len(self.keys)} prompts "
                "(beams or num_return_sequences), and moetune seeds one stream a prompt row",
                "sample one completion a row: TRL repeats each prompt num_generations times",
            )
        if not self.generators:
            self.generators = [_generator(key, scores.device) for key in self.keys]
        probs = torch.softmax(scores.float(), dim=-1)
        chosen = torch.stack([torch.multinomial(p, 1, generator=g)
                              for p, g in zip(probs, self.generators, strict=True)])  # fmt: skip
        self.steps += 1
        return torch.full_like(scores, float("-inf")).scatter_(1, chosen, 0.0)


def _generator(seed: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


@contextmanager
def sampling_rows(model: Any, sampler: RowSampler) -> Iterator[RowSampler]:
    """While inside, `model`'s generate (a peft model's: the transformers model under it)
    samples with `sampler`; on leaving, a sampling call the sampler never saw is refused."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    build = getattr(type(base), _CHAIN, None)
    if build is None:
        raise _bypassed(base)

    def chain(*args: Any, **kwargs: Any) -> Any:
        processors = build(base, *args, **kwargs)
        processors.append(sampler)  # last: after the warpers, where generate samples
        return processors

    base.__dict__[_CHAIN] = chain
    try:
        yield sampler
    finally:
        del base.__dict__[_CHAIN]
    if not sampler.steps:
        raise _bypassed(base)


def _bypassed(base: Any) -> TrainError:
    return TrainError(
        f"{type(base).__name__}.generate sampled without moetune's per-row sampler "
        f"(this transformers release builds its logits chain outside {_CHAIN})",
        "install the transformers version moetune's extras pin, or report the version",
    )


class RowSampling:
    """Mixin before a GRPOTrainer class: its own (transformers) rollouts sample per row."""

    def _generate_single_turn(self, prompt_ids: list[Any], *args: Any, **kwargs: Any) -> Any:
        trainer: Any = self
        if trainer.use_vllm or getattr(trainer, "use_transformers_continuous_batching", False):
            # sampled by another engine (train.grpo.use_vllm), not by generate's logits chain
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)  # type: ignore[misc]
        rows, rank = len(prompt_ids), trainer.accelerator.process_index
        sampler = RowSampler(trainer.args.seed, trainer.state.global_step, rank * rows, rows)
        with sampling_rows(trainer.accelerator.unwrap_model(trainer.model), sampler):
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)  # type: ignore[misc]


def with_row_sampling(trainer: type) -> type:
    """A subclass of the GRPO trainer class whose rollouts sample per row."""
    return type(f"{trainer.__name__}RowSampled", (RowSampling, trainer), {})
