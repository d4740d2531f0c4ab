"""Is the adapter live in the rollouts? GRPO samples with one engine and trains with another
pass; an engine that drops expert LoRA samples from the base, not the policy (unsloth-zoo
#1250), and nothing fails – the policy gradient is simply taken on someone else's samples.

`LiveCheck` hooks the (peft-wrapped) model's base forward. During the first rollout it keeps,
for the first row, the log-probabilities each generate call gave the token fed next (the
rollout's own log-probs); when the training pass sees that row it takes the policy's
log-probs of the same tokens, and after the step the base's (adapter disabled, one forward).
The verdict: "live" when the rollout is closer to the policy than to the base, "base" when
closer to the base – then the run stops with the fix. While the adapter is still ~zero (the
first step of a fresh LoRA) policy and base agree and nothing can be told apart: the check
repeats on the next rollouts, up to `tries` steps, and says "undecided" after.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from moetune.train.errors import TrainError
from moetune.train.routing.modes import measuring

SEPARATION = 1e-3  # policy vs base log-prob gap (max over tokens) needed to tell them apart
MAX_TOKENS = 64  # sampled positions compared: a vocab-sized fp32 row each (151k: 0.6 MB)


@dataclass
class _Sample:
    """The first rollout row: tokens fed so far, and per fed count the next-token log-probs."""

    tokens: list[torch.Tensor] = field(default_factory=list)
    logps: dict[int, torch.Tensor] = field(default_factory=dict)  # tokens fed -> [vocab]
    policy: dict[int, float] = field(default_factory=dict)  # tokens fed -> policy log-prob
    full: torch.Tensor | None = None  # the row as the training pass saw it (no padding)
    closed: bool = False  # a later generate call of the same step: not this sample's

    def ids(self) -> torch.Tensor:
        return torch.cat(self.tokens) if self.tokens else torch.empty(0, dtype=torch.long)


def row_logps(
    logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0
) -> dict[int, Any]:
    """Per position of one row: tokens fed up to and including it -> its next-token
    log-probs (`logits` may cover only the last positions, as TRL's logits_to_keep does)."""
    fed = mask.long().cumsum(0)
    start = ids.shape[0] - logits.shape[0]
    return {
        int(fed[start + j]): (logits[j].float() / temperature).log_softmax(-1)
        for j in range(logits.shape[0])
        if mask[start + j]
    }


class LiveCheck(TrainerCallback):
    """Compares the rollout's log-probs of a sample with the policy's and the base's."""

    def __init__(
        self, model: nn.Module, temperature: float = 1.0, tries: int = 3, stop: bool = True
    ) -> None:
        self.model, self.temperature, self.tries, self.stop = model, temperature, tries, stop
        self.sample: _Sample | None = None
        self.result: dict[str, Any] = {"verdict": "undecided", "steps": 0}
        self._phase: str | None = None
        self._inputs: tuple[torch.Tensor, torch.Tensor] | None = None
        get_base = getattr(model, "get_base_model", None)
        base: nn.Module = get_base() if callable(get_base) else model
        self._handles = [
            base.register_forward_pre_hook(self._begin, with_kwargs=True),
            base.register_forward_hook(self._end),
        ]

    @property
    def done(self) -> bool:
        return self.result["verdict"] != "undecided" or self.result["steps"] >= self.tries

    def _begin(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._phase = None
        if self.done or not isinstance(ids, torch.Tensor):
            return
        mask = kwargs.get("attention_mask")
        mask = mask if isinstance(mask, torch.Tensor) else torch.ones_like(ids)
        self._inputs = (ids, mask[:, -ids.shape[1] :].bool())
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None:
            self._phase = "rollout"
            if self.sample is not None and self.sample.tokens and cache_empty(cache):
                self.sample.closed = True
        elif torch.is_grad_enabled() and module.training and self.sample is not None:
            self._phase = "train"

    def _end(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        phase, self._phase = self._phase, None
        if phase is None or self._inputs is None:
            return
        ids, mask = (t[0].detach().cpu() for t in self._inputs)
        logits = getattr(output, "logits", None)
        with torch.no_grad():
            if phase == "rollout" and isinstance(logits, torch.Tensor):
                self._keep(ids, mask, logits[0, -1:])
            elif phase == "train":
                self._policy(output, self._inputs)

    def _keep(self, ids: torch.Tensor, mask: torch.Tensor, last: torch.Tensor) -> None:
        sample = self.sample if self.sample is not None else _Sample()
        self.sample = sample
        if sample.closed:
            return
        sample.tokens.append(ids[mask])
        if len(sample.logps) < MAX_TOKENS:  # later positions: their tokens only
            row = (last[0].detach().float() / self.temperature).log_softmax(-1)
            sample.logps[len(sample.ids())] = row.cpu()

    def _policy(self, output: Any, inputs: tuple[torch.Tensor, torch.Tensor]) -> None:
        assert self.sample is not None
        want = self.sample.ids()
        for b in range(inputs[0].shape[0]):
            ids, mask = inputs[0][b].cpu(), inputs[1][b].cpu()
            if torch.equal(ids[mask][: len(want)], want):
                self.sample.full = ids[mask]
                self.sample.policy = self._policy_row(output, b, ids, mask)
                return

    def _policy_row(
        self, output: Any, b: int, ids: torch.Tensor, mask: torch.Tensor
    ) -> dict[int, float]:
        """The training pass's log-probs of one row: from its logits, or – TRL's fused LM
        head returns no logits – its per-token `log_probs` (temperature-scaled already)."""
        assert self.sample is not None
        logits = getattr(output, "logits", None)
        if isinstance(logits, torch.Tensor):
            per = row_logps(logits[b].detach().cpu(), ids, mask, self.temperature)
            return _picked(per, ids[mask], self.sample.logps)
        logps, labelled = output.log_probs[b].detach().cpu(), output.label_mask[b].cpu()
        fed = mask.long().cumsum(0)
        return {
            int(fed[p]): float(logps[p])
            for p in range(logps.shape[0])
            if mask[p] and labelled[p] and int(fed[p]) in self.sample.logps
        }

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        sample, self.sample = self.sample, None
        if self.done or sample is None or not sample.policy:
            return
        self.result = self.verdict(sample, self.base_logps(sample))
        self.result["step"] = state.global_step
        if self.result["verdict"] == "base" and self.stop:
            raise TrainError(*refusal(self.result))

    def base_logps(self, sample: _Sample) -> dict[int, float]:
        """The base's log-probs of the sample's tokens (adapter disabled, no grad)."""
        assert sample.full is not None
        ids = sample.full.unsqueeze(0).to(next(self.model.parameters()).device)
        peft: Any = self.model  # a PeftModel: disable_adapter() turns every LoRA off
        disable: Callable[[], Any] = peft.disable_adapter
        with measuring(self.model), disable():  # quantised kernels keep their train mode
            self._phase = None
            logits = self.model(input_ids=ids).logits[0].cpu()
        every = torch.ones(ids.shape[1], dtype=torch.bool)
        per = row_logps(logits, ids[0].cpu(), every, self.temperature)
        return _picked(per, ids[0].cpu(), sample.logps)

    def verdict(self, sample: _Sample, base: dict[int, float]) -> dict[str, Any]:
        assert sample.full is not None
        ids = sample.full
        keys = sorted(k for k in sample.policy if k in base)
        rollout = {k: float(sample.logps[k][ids[k]]) for k in keys}
        gap = _max_gap(sample.policy, base, keys)
        to_policy, to_base = _max_gap(rollout, sample.policy, keys), _max_gap(rollout, base, keys)
        steps = self.result["steps"] + 1
        verdict = "undecided"
        if gap > SEPARATION:
            verdict = "live" if to_policy < to_base else "base"
        return {"verdict": verdict, "steps": steps, "tokens": len(keys),
                "rollout_vs_policy": to_policy, "rollout_vs_base": to_base,
                "policy_vs_base": gap}  # fmt: skip

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def cache_empty(cache: Any) -> bool:
    """A generate call's first forward: its KV cache holds nothing yet."""
    length = getattr(cache, "get_seq_length", None)
    return bool(callable(length) and length() == 0)


def _picked(
    per: dict[int, torch.Tensor], tokens: torch.Tensor, rollout: dict[int, torch.Tensor]
) -> dict[int, float]:
    """Tokens fed -> log-prob of the token that follows, where the rollout has one too."""
    return {k: float(v[tokens[k]]) for k, v in per.items() if k in rollout and k < len(tokens)}


def _max_gap(a: dict[int, float], b: dict[int, float], keys: list[int]) -> float:
    return max((abs(a[k] - b[k]) for k in keys), default=0.0)


def refusal(result: dict[str, Any]) -> tuple[str, str]:
    return (
        f"the rollout samples from the base, not the policy: its log-probs of a sample are "
        f"{result['rollout_vs_base']:.2g} from the base's and {result['rollout_vs_policy']:.2g} "
        "from the adapter's (the generating engine drops the LoRA)",
        "generate with TRL's own generation (train.grpo.use_vllm: false), or an engine "
        "that applies expert LoRA",
    )
