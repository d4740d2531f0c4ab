"""train/distributed/zero3_load.py on CPU, without DeepSpeed: what a ZeRO-3 forward gathers, and
when
(the 2-rank runs under DeepSpeed are in tests/test_train_distributed.py, `-m deepspeed`)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from moetune.train.distributed import zero3_load


def _tiny() -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).eval()


@pytest.fixture
def partitioned(monkeypatch):
    """A tiny model whose parameters carry a ds_id (as ZeRO-3 marks its partitioned ones),
    and every gather's parameter names, in order, with GatheredParameters stood in for."""
    model = _tiny()
    for i, param in enumerate(model.parameters()):
        param.ds_id = i
    names = {id(p): n for n, p in model.named_parameters()}
    gathers: list[set[str]] = []
    live: list[int] = []  # units gathered at once, now

    @contextlib.contextmanager
    def gathered(params):
        gathers.append({names[id(p)] for p in params})
        live.append(1)
        assert len(live) == 1, "two units gathered at once"
        yield
        live.pop()

    monkeypatch.setattr(zero3_load, "gathered", gathered)
    return model, gathers, live


def test_a_zero3_forward_gathers_one_decoder_layer_at_a_time(partitioned):
    """Each decoder layer whole (peft's wrappers read their base's parameter in their own
    forward), each module outside the layers by itself, every parameter once, one at a time."""
    model, gathers, live = partitioned
    with zero3_load.gathered_forward(model), torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    layer = {n for n, _ in model.named_parameters() if n.startswith("model.layers.0.")}
    assert layer in gathers and any("mlp.experts.gate_up_proj" in n for n in layer)
    assert not live
    every = [n for g in gathers for n in g]
    assert sorted(every) == sorted(n for n, _ in model.named_parameters())  # each once
    assert len(gathers) == 2 + 3  # 2 layers; embeddings, final norm, LM head
    hooks = [m for m in model.modules() if m._forward_pre_hooks or m._forward_hooks]
    assert hooks == []  # removed on the way out


def test_a_forward_that_raises_releases_what_it_gathered(partitioned):
    model, gathers, live = partitioned
    with pytest.raises(IndexError), zero3_load.gathered_forward(model):
        model(torch.tensor([[1, 2, 99]]))  # past the vocabulary: the embedding raises
    assert gathers and not live


def test_without_zero3_parameters_nothing_is_hooked():
    model = _tiny()
    with zero3_load.gathered_forward(model):
        assert not any(m._forward_pre_hooks for m in model.modules())


def test_held_bytes_counts_each_partition_not_its_placeholder():
    """A ZeRO-3 parameter's data is an empty placeholder; its partition is ds_tensor."""
    model = torch.nn.Linear(4, 8, bias=False)
    param = model.weight
    param.ds_tensor = torch.zeros(16)  # its half of 32 floats
    param.ds_id = 0
    param.data = torch.empty(0)
    assert zero3_load.held_bytes(model) == 16 * 4
