"""Data-dependent ops in a traced step (plan.balanced): an eager expert loop that reads
its routing with nonzero / .item() / .tolist() traces on fake tensors, routed balanced,
and allocates what the same step allocates for real."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from moetune.errors import TraceError
from moetune.plan.trace.balanced import BalancedRouting, balanced_indices, balanced_topk
from moetune.plan.trace.bytes import ByteTracker

TOKENS, DIM, EXPERTS, TOP_K = 12, 8, 4, 2


class EagerExperts(nn.Module):
    """The loop transformers' eager MoE blocks run (longcat_flash, glm5_next, step3p5),
    with jetmoe's `.tolist()` of the expert sizes beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.w = nn.Parameter(torch.randn(EXPERTS, DIM, DIM) / DIM)
        self.sizes: list[int] = []
        self.counts: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = self.router(x).softmax(-1).topk(TOP_K, dim=-1)
        mask = F.one_hot(index, EXPERTS).permute(2, 1, 0)  # (experts, top_k, tokens)
        self.counts = mask.sum(dim=(1, 2)).tolist()
        out = torch.zeros_like(x)
        self.sizes = []
        for hit in (mask.sum(dim=(-1, -2)) > 0).nonzero():
            expert = int(hit.item())
            slot, token = torch.where(mask[expert])
            self.sizes.append(token.shape[0])
            y = (x[token] @ self.w[expert]) * weights[token, slot, None]
            out = out.index_add(0, token, y)
        return out


def _step(fake: bool) -> tuple[EagerExperts, ByteTracker]:
    torch.manual_seed(0)
    block, tracker = EagerExperts(), ByteTracker()
    x = torch.randn(TOKENS, DIM)
    if not fake:
        with BalancedRouting(None), tracker:
            block(x).sum().backward()
        return block, tracker
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, BalancedRouting(mode) as routing:
        block.to_empty(device="cpu")
        fx = mode.from_tensor(x)
        with tracker:
            block(fx).sum().backward()
    assert routing.answered > 0
    return block, tracker


def test_balanced_routing_gives_every_expert_top_k_tokens_over_n() -> None:
    index = balanced_indices(TOKENS, TOP_K, EXPERTS)
    assert torch.bincount(index.flatten(), minlength=EXPERTS).tolist() == [6, 6, 6, 6]
    assert all(len(set(row.tolist())) == TOP_K for row in index)  # k distinct per token
    moved = balanced_topk(torch.Size([EXPERTS, 3, 5]), 2, 0)  # experts on dim 0
    assert moved.shape == (2, 3, 5) and moved.max().item() == EXPERTS - 1


def test_an_eager_expert_loop_traces_on_fake_tensors_balanced() -> None:
    block, _ = _step(fake=True)
    assert block.sizes == [TOKENS * TOP_K // EXPERTS] * EXPERTS  # 6 tokens each
    assert block.counts == [6, 6, 6, 6]  # .tolist() answered with the real numbers


def test_the_fake_step_allocates_what_the_real_balanced_step_does() -> None:
    real_block, real = _step(fake=False)
    fake_block, fake = _step(fake=True)
    assert real_block.sizes == fake_block.sizes == [6, 6, 6, 6]
    assert fake.peak.bytes == real.peak.bytes > 0
    assert (fake.peak.op, fake.peak.phase) == (real.peak.op, real.peak.phase)


def test_a_real_step_under_balanced_routing_still_learns_from_its_scores() -> None:
    """The real step's routing is replaced, its weights are the router's at those experts."""
    torch.manual_seed(0)
    logits = torch.randn(TOKENS, EXPERTS)
    with BalancedRouting(None):
        values, index = logits.topk(TOP_K, dim=-1)
    assert torch.equal(index, balanced_indices(TOKENS, TOP_K, EXPERTS))
    assert torch.equal(values, logits.gather(-1, index))


def test_values_computed_from_weights_are_refused_with_the_op_named() -> None:
    layer = nn.Linear(DIM, EXPERTS)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, BalancedRouting(mode):
        layer.to_empty(device="cpu")
        scores = layer(mode.from_tensor(torch.randn(TOKENS, DIM)))
        with pytest.raises(TraceError, match="nonzero"):
            (scores > 0).nonzero()


def test_in_place_writes_keep_the_value_known() -> None:
    """Counts built in place (index_add_, a foreach step) read back as the real numbers."""
    with FakeTensorMode() as mode, BalancedRouting(mode):
        counts = torch.zeros(EXPERTS, dtype=torch.long)
        index = torch.tensor([0, 2, 2, 3])
        counts.index_add_(0, index, torch.ones(4, dtype=torch.long))
        steps = [torch.zeros(2), torch.zeros(3)]
        torch._foreach_add_(steps, 1.0)
        assert counts.tolist() == [1, 0, 2, 1]
        assert steps[1].tolist() == [1.0, 1.0, 1.0]
