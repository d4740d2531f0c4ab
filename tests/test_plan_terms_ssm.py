"""The state-space terms against what the mixers really save: a real bf16 forward of one
frozen Mamba mixer (transformers' torch path) whose input needs a gradient, its saved tensors
counted by unique storage at two lengths; the slope per token is what the term sizes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moetune.model import spec_from_config
from moetune.model.census import shrunk_config
from moetune.model.spec import ModelSpec
from moetune.plan.profiles.ssm import mamba1_scan, mamba2_chunked


def _saved_bytes(mixer: torch.nn.Module, hidden: int, seq: int) -> int:
    """Bytes of the distinct non-parameter storages autograd keeps for one forward."""
    params = {p.untyped_storage().data_ptr() for p in mixer.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            kept[s.data_ptr()] = s.nbytes()
        return t

    x = torch.randn(1, seq, hidden, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = mixer(x)
    del out
    return sum(kept.values())


def _slope(mixer: torch.nn.Module, hidden: int, seqs: tuple[int, int]) -> float:
    a, b = (_saved_bytes(mixer, hidden, s) for s in seqs)
    return (b - a) / (seqs[1] - seqs[0])


def _mixer(model_type: str, over: dict[str, Any]) -> tuple[torch.nn.Module, ModelSpec]:
    from transformers import AutoConfig

    raw = {**shrunk_config(model_type), **over}
    spec = spec_from_config(raw, model_type)
    config = AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != "model_type"})
    if model_type == "jamba":
        from transformers.models.jamba.modeling_jamba import JambaMambaMixer as Mixer
    else:
        from transformers.models.nemotron_h.modeling_nemotron_h import (
            NemotronHMamba2Mixer as Mixer,
        )
    torch.manual_seed(0)
    mixer = Mixer(config, layer_idx=0).to(torch.bfloat16).requires_grad_(False)
    return mixer, spec


@pytest.mark.parametrize(
    "over",
    [{}, {"mamba_d_state": 32}, {"mamba_expand": 4}, {"hidden_size": 96, "mamba_d_state": 8}],
)
def test_mamba1_term_is_the_recurrent_scans_saved_bytes_per_token(over: dict[str, Any]) -> None:
    """Exact: the per-step fp32 state and its bf16 copy, exp(A·dt) and B·dt (14·I·N) …"""
    mixer, spec = _mixer("jamba", over)
    assert _slope(mixer, spec.hidden_size, (32, 64)) == mamba1_scan(spec)


@pytest.mark.parametrize(
    ("over", "rel"),
    [
        ({}, 0.005),
        ({"mamba_num_heads": 8, "chunk_size": 16}, 0.005),
        # held out of the fit (head dim 8, N 32, 2 groups): the term is 1.9 % low
        ({"ssm_state_size": 32, "n_groups": 2, "mamba_head_dim": 8}, 0.025),
    ],
)
def test_mamba2_term_is_the_chunked_scans_saved_bytes_per_token(
    over: dict[str, Any], rel: float
) -> None:
    """Fitted on six shapes (see plan.profiles.ssm) to the saved tensors' slope over tokens."""
    mixer, spec = _mixer("nemotron_h", over)
    chunk = spec.hf_config["chunk_size"]
    measured = _slope(mixer, spec.hidden_size, (4 * chunk, 8 * chunk))
    assert mamba2_chunked(spec) == pytest.approx(measured, rel=rel)
