"""`train.offload` with `train.ep_placement: balanced` (engine/ep_placement.py's `place`,
engine/offload/load.py's `hold_experts`): each rank's ExpertStore, loaded with its contiguous
E/N experts, reads its placed experts from the base's files instead (not side by side, cut by
stack_files.experts_segments), while the LoRA slices move by the all-to-all. Forked 2 gloo
ranks over a bf16 base sharded into many small files, offload cpu and disk, float64: logits
and every LoRA gradient equal one process without offload (1e-12); each rank's store holds
exactly its placed experts' bytes, bit for bit the base's. Slow: `moetune train --nproc 2
--strategy ep` balanced with offload disk against one process with offload disk."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from test_ep_partitioned_load import _qwen3
from test_ep_placement import ORDERS
from test_ep_quantized import _grads, _rank_diffs, _wrapped

pytestmark = pytest.mark.filterwarnings("ignore")
WORLD, MODULES = 2, ["q_proj", "v_proj"]


def _rank(rank: int, base: str, out: str) -> None:
    """Per mode: one process without offload on the whole batch; this rank's store, placed
    by ORDERS (rank 0 holds experts {0, 3} then {1, 2}), on its half."""
    from transformers import AutoModelForCausalLM

    from moetune.engine.ep_lora import shard_lora
    from moetune.engine.ep_placement import place
    from moetune.engine.expert_parallel import _SHARD, ep_mesh, shard_experts
    from moetune.engine.offload.load import load_offloaded
    from moetune.engine.offload.store import offloaded_of

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=120))  # fmt: skip
    torch.manual_seed(3)
    ids, weights = torch.randint(0, 64, (2 * WORLD, 12)), torch.randn(2 * WORLD, 12, 64)
    one = _wrapped(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64), MODULES)
    stacks = {n: p.detach().clone() for n, p in one.named_parameters() if n.endswith("_proj")
              and p.ndim == 3}  # fmt: skip
    want, found = _grads(one, ids, weights.double()), {}
    for mode in ("cpu", "disk"):
        model, store, _ = load_offloaded(Path(base), mode, "cpu", torch.float64, part=(rank, 2))
        model = _wrapped(model, MODULES)
        shard_experts(model, ep_mesh("cpu"))
        shard_lora(model)
        layers = [(p, m) for p, m in model.named_modules() if _SHARD in m.__dict__]
        before = store.stats.stored_bytes
        for (_, experts), order in zip(layers, ORDERS, strict=True):
            place(experts, order)
        mine = [list(order[rank * 2 : rank * 2 + 2]) for order in ORDERS]
        held = {}  # each stack the store holds: equal to the base's placed experts?
        for (path, experts), placed in zip(layers, mine, strict=True):
            for name, ref in offloaded_of(experts).items():
                want_rows = next(v for k, v in stacks.items() if k.endswith(f"{path}.{name}"))
                held[f"{path}.{name}"] = bool(torch.equal(ref.fetch(), want_rows[placed]))
        diffs = _rank_diffs(
            model, ids, weights.double(), want, slice(rank * 2, rank * 2 + 2), WORLD
        )
        layer_bytes = [sum(s.nbytes for s, _ in layer.values()) for layer in store.layers]
        found[mode] = {"diff": max(diffs), "grads": len(diffs) - 1, "held": held,
                       "stored_before": before, "layer_bytes": layer_bytes,
                       "stored_bytes": store.stats.stored_bytes}  # fmt: skip
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def _expert_bytes(base: Path) -> int:
    """Every routed expert tensor's bytes in the base's files (safetensors' own reader)."""
    from safetensors import safe_open

    total = 0
    for file in base.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if ".mlp.experts." in key:
                    t = f.get_tensor(key)
                    total += t.numel() * t.element_size()
    return total


def test_offloaded_balanced_placement_equals_one_process(tmp_path):
    """2 ranks, experts {0, 3} / {1, 2} on rank 0 per layer, offload cpu and disk: logits
    and every LoRA gradient equal one process without offload (float64, 1e-12); each rank's
    store holds its placed experts bit for bit – half the experts' bytes in the files, as
    many as before placing."""
    base = _qwen3(tmp_path / "base")
    assert len(list(base.glob("*.safetensors"))) > 4  # experts split over many small files
    mp.start_processes(_rank, args=(str(base), str(tmp_path)), nprocs=WORLD,
                       start_method="fork")  # fmt: skip
    experts = _expert_bytes(base)
    for rank in range(WORLD):
        for mode, got in json.loads((tmp_path / f"rank{rank}.json").read_text()).items():
            assert got["diff"] < 1e-12, (mode, got)
            assert got["grads"] >= 8, mode  # attention and every expert stack's A and B
            assert len(got["held"]) == 4 and all(got["held"].values()), (mode, got["held"])
            # bf16 in the files: cpu widens nothing (it keeps the stored dtype), disk reads it
            assert sum(got["layer_bytes"]) * WORLD == experts, (mode, got)
            assert got["stored_bytes"] == got["stored_before"] == sum(got["layer_bytes"])


def test_the_launcher_lets_offload_run_with_a_balanced_placement(tmp_path):
    """train.offload disk under ep with train.ep_placement balanced passes the launcher's
    check (it was refused); with train.ep_degree it is still refused, one line with a fix."""
    from moetune.config import parse_config
    from moetune.train.distributed.nodes import check_one_process
    from moetune.train.errors import TrainError

    train = {"offload": "disk", "strategy": "ep", "nproc": 2, "ep_placement": "balanced"}
    check_one_process(parse_config({"model": {"id": "x"}, "train": train}))
    with pytest.raises(TrainError, match=r"train\.ep_degree 2") as refused:
        check_one_process(parse_config({"model": {"id": "x"}, "train": {**train,
                          "ep_placement": "contiguous", "ep_degree": 2, "nproc": 4}}))  # fmt: skip
    assert "train.offload: none" in refused.value.fix


# ---------------------------------------------------------------- the CLI (slow)


@pytest.mark.slow
def test_cli_balanced_ep_with_disk_offload_trains_as_one_process_with_offload(tmp_path):
    """`moetune train --nproc 2 --strategy ep` with train.ep_placement balanced and
    train.offload disk (each rank's store re-reading its placed experts) against one process
    with train.offload disk, batch 2 × 2 against 4, 3 steps: every step's loss and every
    adapter tensor equal (fp32, 1e-5); the placement moved experts; each rank's store holds
    half the experts' bytes."""
    from moetune.config import dump_config
    from test_ep_quantized import _losses
    from test_train_distributed import _rel_diff, _train
    from test_train_helpers import reverse_rows, run_config, save_tiny_model, write_jsonl

    base = save_tiny_model(tmp_path / "base")
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(24))

    def write(name: str, **more: Any) -> Path:
        cfg = run_config(base, data, tmp_path / name, max_steps=3, save_steps=3,
                         lora__targets=["attention", "experts"], offload="disk",
                         lora__engine="moetune", **more)  # fmt: skip
        (tmp_path / f"{name}.yaml").write_text(dump_config(cfg))
        return tmp_path / f"{name}.yaml"

    _train(write("two", batch_size=2, nproc=2, strategy="ep", ep_placement="balanced"),
           log=tmp_path / "two.log")  # fmt: skip
    _train(write("one", batch_size=4), log=tmp_path / "one.log")
    got, want = _losses(tmp_path / "two"), _losses(tmp_path / "one")
    assert len(got) == len(want) == 3
    assert max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)) < 1e-5
    assert _rel_diff(tmp_path / "two", tmp_path / "one") < 1e-5
    placed = json.loads((tmp_path / "two" / "ep_placement.json").read_text())
    assert any(sorted(o) != o for o in placed["orders"].values())  # experts did move
    two = json.loads((tmp_path / "two" / "offload.json").read_text())
    one = json.loads((tmp_path / "one" / "offload.json").read_text())
    assert [r["stored_bytes"] * 2 for r in two["ranks"]] == [one["stored_bytes"]] * 2


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    from test_train_helpers import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("ep-offload-balanced") / "model")


@pytest.mark.parametrize("mode", ["cpu", "disk"])
def test_a_placed_store_is_what_the_plan_counts_under_either_placement(tiny_base, mode):
    """One rank's store (rank 1 of 2) over the tiny fp32 base, made to hold experts 0 and 3
    of every layer (hold_experts, no collective): each stack fetched is the base's experts
    0 and 3 bit for bit, and its stored and per-layer bytes are still the per-rank plan's,
    which is the same for contiguous and balanced placements."""
    from moetune.config import parse_config
    from moetune.engine.offload.load import hold_experts, load_offloaded
    from moetune.engine.offload.store import offloaded_of
    from moetune.model import load_spec
    from moetune.plan.devices.ep_offload import plan_ep_offload

    base = tiny_base
    whole = load_offloaded(base, mode, "cpu", torch.float32)[0]
    want = {p: {n: r.fetch().clone() for n, r in offloaded_of(m).items()}
            for p, m in whole.named_modules() if offloaded_of(m)}  # fmt: skip
    model, store, _ = load_offloaded(base, mode, "cpu", torch.float32, part=(1, 2))
    for path, module in model.named_modules():
        if offloaded_of(module):
            hold_experts(module, [0, 3])
            for name, ref in offloaded_of(module).items():
                assert torch.equal(ref.fetch(), want[path][name][[0, 3]]), (path, name)
    spec, plans = load_spec(str(base)), []
    for placement in ("contiguous", "balanced"):
        cfg = parse_config({"model": {"id": str(base)}, "lora": {"rank": 4},
                            "train": {"offload": mode, "strategy": "ep", "nproc": 2,
                                      "ep_placement": placement, "device": "cpu",
                                      "seq_len": 32}})  # fmt: skip
        plans.append(plan_ep_offload(spec, cfg, None, 2, 2))
    assert plans[0].offloaded_bytes == plans[1].offloaded_bytes == store.stats.stored_bytes
    assert plans[1].layer_expert_bytes == store.stats.layer_bytes
    assert sum(sum(s.nbytes for s, _ in layer.values()) for layer in store.layers) == (
        store.stats.stored_bytes
    )


def test_a_store_that_cannot_hold_other_experts_is_refused(tiny_base):
    """hold_experts on a rank's store of NF4 stacks (quantised at the load: nothing to
    re-read), or asked for more experts than the rank holds: one line and its fix."""
    from moetune.engine.offload.load import hold_experts, load_offloaded
    from moetune.engine.offload.store import offloaded_of
    from moetune.engine.stack_files import OffloadError

    base = tiny_base
    for dtype, ids in (("nf4", [0, 3]), ("bf16", [0, 1, 3])):
        model = load_offloaded(base, "cpu", "cpu", torch.float32, experts_dtype=dtype,
                               part=(0, 2))[0]  # fmt: skip
        module = next(m for m in model.modules() if offloaded_of(m))
        with pytest.raises(OffloadError, match="cannot hold experts") as refused:
            hold_experts(module, ids)
        assert "train.ep_placement: contiguous" in refused.value.fix
