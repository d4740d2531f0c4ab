"""`--resume` after kill -9 of a 2-rank `train.strategy ep` run placed balanced (its expert
LoRA sliced and moved with its experts, the checkpoint whole in the base's order) and of one
with expert groups (`train.ep_degree`, the rest and all the LoRA FSDP2-sharded), and of a
balanced one with offload disk (each store re-reading its placed experts): the resumed
run ends with the uninterrupted run's adapter and losses. Slow tier: 3 CLI runs each."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from test_train_distributed import _kill_9_after_step_2, _moetune, _rel_diff, _train, _wait_released
from test_train_expert_parallel import _losses


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_train_helpers import tiny_run

    return tiny_run(tmp_path_factory.mktemp("ep-resume"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "placed",
    [{"ep_placement": "balanced"}, {"ep_degree": 2},
     # each rank's store re-reads its kept placement's experts (offload/load.py hold_experts)
     {"offload": "disk", "ep_placement": "balanced", "lora__engine": "moetune"}],
    ids=["balanced", "ep_degree", "balanced-offload"],
)  # fmt: skip
def test_ep_resume_after_kill_9_gives_the_uninterrupted_adapter(tiny, placed):
    """2 ep ranks, 6 steps, a checkpoint every 2; kill -9 of the launcher once step 2 is
    committed, then `--resume`: the adapter equals the uninterrupted run's (1e-5), and so
    does every loss after the resume. The checkpoint's adapter is whole (every expert's
    factors, [r·E, in] for A)."""
    from test_train_distributed import _write

    name = next(iter(placed))
    over = {"max_steps": 6, "save_steps": 2, "batch_size": 2, "nproc": 2, "strategy": "ep",
            **placed}  # fmt: skip
    whole = tiny.root / f"{name}-uninterrupted"
    _train(_write(tiny, whole.name, **over), log=tiny.root / f"{whole.name}.log")
    config = _write(tiny, f"{name}-killed", **over)
    out, log = tiny.root / f"{name}-killed", tiny.root / f"{name}-killed.log"
    _kill_9_after_step_2(_moetune("train", str(config), log=log), out, log)
    _wait_released(out)  # the ranks die with the launcher and free the run dir
    adapter = load_file(str(out / "checkpoints" / "step-2" / "adapter_model.safetensors"))
    a = next(v for k, v in adapter.items() if "experts" in k and "lora_A" in k)
    assert a.shape[0] == 4 * 4  # r 4 × 4 experts: whole, not one rank's
    result = _train(config, "--resume", log=tiny.root / f"{name}-resumed.log")
    assert result["resumed_from_step"] == 2 and result["steps"] == 6
    assert _rel_diff(out, whole) < 1e-5
    got, want = _losses(out)[-4:], _losses(whole)[-4:]  # steps 3-6, after the resume
    assert max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)) < 1e-5
    if "ep_placement" in placed:  # the placement the run kept, reused by the resume
        kept = json.loads((out / "ep_placement.json").read_text())["orders"]
        assert kept == json.loads((whole / "ep_placement.json").read_text())["orders"]
