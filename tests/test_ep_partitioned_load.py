"""`train.strategy ep` loads a base partitioned (engine/ep_load.py): each rank reads only its
experts' bytes from the safetensors, before load – per-expert keys (qwen3_moe as
transformers saves it) and fused keys (gpt_oss), each through a sharded index. The rank's
expert stacks equal the slice of a full from_pretrained load, the bytes it requested are
exactly 1/N of the stacks', and transformers' loader never opens an expert key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from moetune.engine import ep_load, stack_files
from moetune.engine.expert_parallel import READ
from moetune.engine.quant import load as quant_load


def _qwen3(root: Path) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(root, max_shard_size=3000)
    return root


def _gpt_oss(root: Path) -> Path:
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=64, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    torch.manual_seed(0)
    GptOssForCausalLM(config).to(torch.bfloat16).save_pretrained(root, max_shard_size=3000)
    return root


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def saved(request, tmp_path_factory):
    """(checkpoint dir, whether its experts are fused keys), saved by transformers, sharded."""
    root = tmp_path_factory.mktemp(request.param)
    make = _qwen3 if request.param == "qwen3_moe" else _gpt_oss
    return make(root / "base"), request.param == "gpt_oss"


def _stacks(model: Any) -> dict[str, torch.Tensor]:
    """Every routed expert stack by name (3-D float Parameters of the experts modules)."""
    return {f"{path}.{n}": m._parameters[n] for path, m, names in
            quant_load.experts_modules(model) for n in names}  # fmt: skip


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_rank_reads_only_its_experts(saved, monkeypatch, ranks):
    from transformers import AutoModelForCausalLM

    model_dir, fused = saved
    assert len(list(model_dir.glob("*.safetensors"))) > 1  # a sharded index
    keys = set(stack_files.index_dir(model_dir))
    assert any(k.endswith("experts.gate_up_proj") for k in keys) == fused
    asked: list[Any] = []  # every span the expert reads request
    real = stack_files.read_once

    def counted(pieces: Any) -> int:
        asked.extend(p.span for p in pieces)
        return real(pieces)

    monkeypatch.setattr(stack_files, "read_once", counted)
    skipped: list[set[str]] = []
    real_stream = quant_load._stream
    monkeypatch.setattr(ep_load, "_stream", lambda *a, skip, **kw: skipped.append(set(skip))
                        or real_stream(*a, skip=skip, **kw))  # fmt: skip
    full = _stacks(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16))
    stack_bytes = sum(t.numel() * 2 for t in full.values())
    local = 4 // ranks
    for rank in range(ranks):
        asked.clear()
        model = ep_load.load_partitioned(model_dir, "cpu", torch.bfloat16, rank, ranks)
        for name, module_stack in _stacks(model).items():
            assert module_stack.untyped_storage().nbytes() <= 2  # a stand-in, no storage
            path, stack = name.rsplit(".", 1)
            part = model.get_submodule(path).__dict__[ep_load.PART][stack]
            assert torch.equal(part, full[name][rank * local : (rank + 1) * local])
        assert sum(s.nbytes for s in asked) * ranks == stack_bytes  # 1/N, no more
        read = model.__dict__[READ]  # what summary.json's distributed.expert_parallel says
        assert read == {"expert_bytes_read": stack_bytes // ranks,
                        "expert_stack_bytes": stack_bytes}  # fmt: skip
    expert_keys = {k for k in keys if ".experts." in k and "bias" not in k}
    assert all(skip == expert_keys for skip in skipped)  # transformers' loader never reads them
