"""`train.strategy ep` across nodes, and GRPO under ep – slow tier, CLI runs on gloo.

- 2 launchers on loopback ("nodes"), `--nproc 1` and `--nproc 2` each: 2 and 4 ep ranks
  (the 4-rank run is the CLI's 4-rank test: this host's 2 cores allow 2 ranks a launcher).
  Loss per step and the adapter equal one process to 1e-5; every rank's measured peak RSS
  within 10 % of the plan's per-rank CPU figure (what `plan --strategy ep` promises).
- GRPO with `--nproc 2 --strategy ep` (and ddp): the ranks sample their own completions, of
  their own lengths, and every decoding step is an all-to-all (train/distributed/
  ep_generate.py keeps them stepping together). Each completion draws from its own stream
  (train/grpo/row_sampling.py), so the ranks sample what one process samples: the loss per
  step and adapter equal one process to 1e-5. Default tier: GRPO's SFT term (a second
  training forward before the backward) under checkpointed ep is refused by the launcher,
  before any rank starts.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moetune.config import dump_config
from moetune.train import launch as D
from test_train_distributed import _env, _rel_diff, _train, _write
from test_train_expert_parallel import _losses
from test_train_helpers import tiny_cfg, tiny_run, write_jsonl

PEAK_WITHIN = 0.10  # a rank's measured peak RSS against the plan's per-rank figure


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("ep-nodes"))


def _nodes(tiny, name: str, nproc: int, **over) -> None:
    """Node 1's and node 0's launchers on loopback, each `--nproc nproc`; both must end 0."""
    cfg = tiny_cfg(tiny, tiny.root / name, nnodes=2, master_addr="127.0.0.1", nproc=nproc,
                   strategy="ep", **over)  # fmt: skip
    config = tiny.root / f"{name}.yaml"
    config.write_text(dump_config(cfg))
    port, procs = D.free_port(), []
    for k in (1, 0):
        log = tiny.root / f"{name}-node{k}.log"
        cmd = [sys.executable, "-m", "moetune", "train", str(config), "--json", "--node-rank",
               str(k), "--master-port", str(port)]  # fmt: skip
        with log.open("wb") as out, log.with_suffix(".err").open("wb") as err:
            procs.append(subprocess.Popen(cmd, env=_env(), stdout=out, stderr=err))
    for k, proc in zip((1, 0), procs, strict=True):
        code = proc.wait(timeout=900)
        assert code == 0, (tiny.root / f"{name}-node{k}.err").read_text()[-3000:]


def test_grpos_sft_term_under_checkpointed_ep_is_refused_before_any_rank_starts(
    tiny, tmp_path, monkeypatch
):
    """The SFT term's second training forward would meet the recompute replay's one-forward
    rule in every rank, after the load: the launcher says so in one line, exit 2."""
    from typer.testing import CliRunner

    from moetune.cli import app

    started: list = []
    monkeypatch.setattr(D, "_run_ranks", lambda *a: started.append(a) or 1)
    grpo = {"num_generations": 4, "sft_weight": 1.0}
    cfg = tiny_cfg(tiny, tmp_path / "run", nproc=2, method="grpo", grpo=grpo)
    config = tmp_path / "run.yaml"
    config.write_text(dump_config(cfg))
    got = CliRunner().invoke(app, ["train", str(config), "--strategy", "ep"])
    line = " ".join(got.output.split())
    assert got.exit_code == 2 and "Traceback" not in got.output, got.output
    assert "train.grpo.sft_weight adds a second training forward" in line
    assert "fix: set train.gradient_checkpointing: false, or train.grpo.sft_weight: 0" in line
    assert started == [] and not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_ep_on_two_nodes_trains_one_process_within_the_planned_peak(tiny, nproc):
    """fp32, 4 steps, global batch 4: 2 nodes × `nproc` ep ranks against 1 process."""
    steps = {"max_steps": 4, "save_steps": 4}
    one = tiny.root / "one"
    if not one.exists():
        _train(_write(tiny, "one", batch_size=4, **steps), log=tiny.root / "one.log")
    name = f"nodes-{nproc}"
    _nodes(tiny, name, nproc, batch_size=2 // nproc, **steps)
    run = tiny.root / name
    got, want = _losses(run), _losses(one)
    assert len(got) == len(want) == 4
    assert max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)) < 1e-5
    assert _rel_diff(run, one) < 1e-5
    ran = json.loads((run / "summary.json").read_text())["distributed"]
    ranks = ran["expert_parallel"]
    assert ran["world_size"] == len(ranks) == 2 * nproc
    assert [r["first_expert"] for r in ranks] == list(range(0, 4, 4 // (2 * nproc)))
    for rank in ranks:  # each rank's own peak (VmHWM since the first step) against the plan
        assert rank["measured"] == "process_peak_rss"
        assert abs(rank["measured_over_planned"] - 1) < PEAK_WITHIN, ranks


@pytest.mark.slow
def test_ep_grpo_trains_the_adapter_of_one_process(tiny):
    """train.method grpo, 3 steps, fp32, completions up to 12 tokens (ranks end their
    rollouts at different lengths): 2 ep ranks and 2 ddp ranks (batch 4 each) against one
    process (batch 8) – the same completions, loss per step and adapter."""
    from test_train_methods import GRPO, prompt_rows

    prompts = write_jsonl(tiny.root / "prompts.jsonl", prompt_rows(16))
    grpo = {**GRPO, "max_completion_length": 12,
            "rewards": [{"name": "edit_similarity", "column": "answer"}]}  # fmt: skip
    over = {"max_steps": 3, "method": "grpo", "grpo": grpo, "data__train_file": str(prompts)}
    for name, more in (("grpo-one", {"batch_size": 8}),
                       *((f"grpo-{s}", {"batch_size": 4, "nproc": 2, "strategy": s})
                         for s in ("ep", "ddp"))):  # fmt: skip
        _train(_write(tiny, name, **over, **more), log=tiny.root / f"{name}.log")
    one = tiny.root / "grpo-one"
    want = _losses(one)
    assert len(want) == 3 and any(abs(w) > 1e-3 for w in want)  # it learned
    for run in (tiny.root / "grpo-ep", tiny.root / "grpo-ddp"):
        got = _losses(run)
        assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < 1e-5 * max(map(abs, want))
        assert _rel_diff(run, one) < 1e-5
    ran = json.loads((tiny.root / "grpo-ep" / "summary.json").read_text())["distributed"]
    assert all(r["rows_sent"] for r in ran["expert_parallel"])  # the experts did exchange tokens
