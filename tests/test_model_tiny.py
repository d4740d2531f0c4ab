"""Every tiny config the other stages reuse must really train: forward, loss, backward."""

import pytest
import torch

from moetune.model import build_model, spec_from_config
from moetune.model.tiny import TINY_CONFIGS


@pytest.mark.parametrize("variant", sorted(TINY_CONFIGS))
def test_tiny_config_trains_one_step(variant: str) -> None:
    torch.manual_seed(0)
    model = build_model(spec_from_config(TINY_CONFIGS[variant], variant), "cpu", torch.float32)
    ids = torch.randint(3, 60, (2, 8))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and 3.0 < loss.item() < 5.5  # ~ln(64) at random init
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert sum(g is not None and bool(g.abs().sum() > 0) for g in grads) > len(grads) // 2
