"""`moetune launch --nnodes N` (moetune.lane.nodes): the dry run shows every node's command,
bad node counts and host lists are one line, and two ssh "nodes" on 127.0.0.1 (a real sshd)
are provisioned, guarded, staged and trained with each its rank and node 0's address, their
spend summed in the ledger and both torn down."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from moetune.cli import app
from moetune.demo.base import SHIPPED_DIR
from moetune.lane.providers.base import LaneError, Pod, SshTarget
from moetune.lane.providers.ssh import SshProvider, SshTransport
from moetune.ledger import Ledger
from sshd import SKIP_REASON, Sshd, free_port, have_sshd, start_sshd

TOKEN = "hf_" + "Z" * 34  # a secret in lane.env: masked everywhere it could show

# `moetune` on the nodes: records its argv, cwd and env; node 0 writes the run's adapter.
FAKE_MOETUNE = """#!/bin/bash
{ printf '%s\\n' "$@"; echo "XET=$HF_HUB_DISABLE_XET TOKEN=$HF_TOKEN"; } > argv.txt
if [[ " $* " == *" --node-rank 0 "* ]]; then
  mkdir -p run/adapter && echo weights > run/adapter/adapter_model.safetensors
fi
"""


def write_config(tmp: Path, **lane: Any) -> Path:
    data = tmp / "train.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    cfg = {
        "model": {"id": str(SHIPPED_DIR), "dtype": "float32"},
        "data": {"train_file": str(data)},
        "output": {"dir": str(tmp / "runs/lane"), "ledger": str(tmp / ".moetune/ledger.jsonl")},
        "train": {"seq_len": 32, "batch_size": 2, "max_steps": 4, "device": "cpu",
                  "master_port": free_port()},
        "lane": {"provider": "ssh", "poll_s": 0.2, **lane},
    }  # fmt: skip
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_dry_run_shows_each_ssh_nodes_command_with_its_rank_and_node_0(tmp_path: Path) -> None:
    config = write_config(tmp_path, ssh={"port": 2222}, env={"HF_TOKEN": TOKEN})
    args = ["launch", str(config), "--dry-run", "--json", "--nnodes", "3",
            "--hosts", "gpu-a,ops@gpu-b:2200,gpu-c"]  # fmt: skip
    got = CliRunner().invoke(app, args)
    assert got.exit_code == 0, got.output
    plan = json.loads(got.stdout)
    nodes = plan["nodes"]
    assert [n["host"] for n in nodes] == ["root@gpu-a:2222", "ops@gpu-b:2200", "root@gpu-c:2222"]
    port = yaml.safe_load(config.read_text())["train"]["master_port"]
    for rank, node in enumerate(nodes):
        assert node["command"].endswith(
            f" --nnodes 3 --node-rank {rank} --master-addr gpu-a --master-port {port}"
        )
    assert nodes[1]["pod"] == f"{nodes[0]['pod']}-n1" and plan["pod"]["nodes"] == 3
    assert TOKEN not in got.stdout and not (tmp_path / ".moetune").exists()
    table = CliRunner().invoke(app, args[:3] + args[4:])  # the human view: every node's row
    assert table.exit_code == 0 and "3 nodes" in table.stdout
    assert all(f"--node-rank {r}" in table.stdout.replace("\n", " ") for r in range(3))


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--nnodes", "3", "--hosts", "a,b"], "train.nnodes=3 but provider ssh has 2 host(s)"),
        (["--nnodes", "2"], "train.nnodes=2 but provider ssh has 1 host(s)"),
        (["--nnodes", "0", "--hosts", "a"], "train.nnodes"),
        (["--nnodes", "2", "--hosts", "a,b:99999"], "is not [user@]host[:port]"),
        (["--nnodes", "2", "--provider", "local"], "provider local runs one node"),
    ],
)
def test_what_cannot_run_on_several_nodes_is_one_line(
    tmp_path: Path, flags: list[str], says: str
) -> None:
    config = write_config(tmp_path, ssh={"host": "gpu-a"})
    for dry in (["--dry-run"], []):
        got = CliRunner().invoke(app, ["launch", str(config), *dry, *flags])
        assert got.exit_code == 2 and says in got.output, got.output
        assert "Traceback" not in got.output
    assert not (tmp_path / ".moetune").exists() and not (tmp_path / "runs").exists()


def test_an_ssh_launch_with_no_host_is_refused_even_as_a_dry_run(tmp_path: Path) -> None:
    """A dry run used to print a whole launch plan for a provider with nowhere to go."""
    config = write_config(tmp_path)
    for dry in (["--dry-run"], ["--dry-run", "--json"], []):
        got = CliRunner().invoke(app, ["launch", str(config), *dry])
        assert got.exit_code == 2 and "provider ssh has no host" in got.output, got.output
        assert "set lane.ssh.host" in got.output and "Traceback" not in got.output
    assert not (tmp_path / ".moetune").exists() and not (tmp_path / "runs").exists()


PROXY = "-oProxyCommand=/tmp/pwn.sh"  # ssh would run it: an option, not a host


@pytest.mark.parametrize(
    ("flags", "ssh", "says"),
    [
        (["--nnodes", "2", "--hosts", f"{PROXY},gpu-b"], {}, "is not a host name or IP address"),
        (["--nnodes", "2", "--hosts", f"{PROXY}@h1,gpu-b"], {}, "is not a login name"),
        (["--nnodes", "2", "--hosts", "gpu-a,-gpu-b:22"], {}, "is not a host name or IP"),
        ([], {"host": PROXY}, "lane.ssh.host '-oProxyCommand"),
        ([], {"host": "gpu-a", "user": PROXY}, "is not a login name"),
        (["--nnodes", "2", "--hosts", "gpu-a,ops@GPU-A:22"], {}, "names GPU-A:22 twice"),
        (["--nnodes", "2", "--hosts", "gpu-a,gpu-b,gpu-c"], {}, "lists 3 hosts but train.nnodes=2"),
        (["--hosts", "gpu-a,gpu-b"], {}, "lists 2 hosts but train.nnodes=1"),
        (["--nnodes", "2", "--hosts", "127.0.0.1,gpu-b"], {}, "127.0.0.1 is loopback"),
        (["--nnodes", "2", "--hosts", "gpu-a,gpu-b", "--set", "train.master_addr=localhost"], {},
         "localhost is loopback"),
        (["--nnodes", "2", "--hosts", "[::1]:22,[2001:db8::2]"], {}, "::1 is loopback"),
        (["--nnodes", "2", "--hosts", "[gpu-a]:22,gpu-b"], {}, "brackets hold an IPv6 address"),
    ],
)  # fmt: skip
def test_hosts_that_are_options_or_cannot_carry_the_nodes_are_one_line(
    tmp_path: Path, flags: list[str], ssh: dict[str, str], says: str
) -> None:
    """A host or user starting with "-" used to be planned and handed to ssh / rsync as an
    option; a repeated host, a host too many and a loopback node 0 were planned silently."""
    config = write_config(tmp_path, ssh=ssh)
    for dry in (["--dry-run"], ["--dry-run", "--json"], []):
        got = CliRunner().invoke(app, ["launch", str(config), *dry, *flags])
        assert got.exit_code == 2 and says in got.output, got.output
        assert "Traceback" not in got.output
    assert not (tmp_path / ".moetune").exists() and not (tmp_path / "runs").exists()


def test_ipv6_hosts_are_taken_bracketed_or_bare(tmp_path: Path) -> None:
    config = write_config(tmp_path, ssh={"port": 2222})
    args = ["launch", str(config), "--dry-run", "--json", "--nnodes", "3",
            "--hosts", "[2001:db8::1]:2200,ops@[2001:db8::2],2001:db8::3"]  # fmt: skip
    got = CliRunner().invoke(app, args)
    assert got.exit_code == 0, got.output
    nodes = json.loads(got.stdout)["nodes"]
    assert [n["host"] for n in nodes] == [
        "root@[2001:db8::1]:2200", "ops@[2001:db8::2]:2222", "root@[2001:db8::3]:2222"
    ]  # fmt: skip
    port = yaml.safe_load(config.read_text())["train"]["master_port"]
    tail = f" --node-rank 1 --master-addr 2001:db8::1 --master-port {port}"
    assert nodes[1]["command"].endswith(tail)


def test_names_reach_ssh_scp_and_rsync_after_their_options(tmp_path: Path) -> None:
    """Defence in depth: even a checked name goes after `--`, where nothing is an option."""
    t = SshTransport(SshTarget("2001:db8::1", 2200, "ops"), None, tmp_path / "kh", "w")
    argv = t.ssh_argv()
    assert argv[-2:] == ["--", "ops@2001:db8::1"] and argv.index("-p") < argv.index("--")
    spec = t._spec("/r/a")
    assert spec == "ops@[2001:db8::1]:/r/a"
    for got in (t._rsync_argv(spec, "/l/", extra=("--delete",)), t._scp_argv(spec, "/l/")):
        assert got[-3:] == ["--", spec, "/l/"]
    assert t._rsync_argv(spec, "/l/", extra=("--delete",)).index("--delete") < len(got) - 3
    for bad in (SshTarget("-oProxyCommand=x", 22, "root"), SshTarget("h", 22, "-oX=y")):
        with pytest.raises(LaneError, match="is not a"):
            SshTransport(bad, None, tmp_path / "kh", "w")


@pytest.fixture
def server(tmp_path: Path) -> Any:
    if not have_sshd():
        pytest.skip(SKIP_REASON)
    sshd = start_sshd(tmp_path / "sshd")
    yield sshd
    sshd.stop()


def _billed(self: SshProvider, pod_id: str, workdir: str) -> Pod:
    """An ssh pod that reports $1 spent (an ssh box has no price): spends add up."""
    return Pod(pod_id, pod_id, "running", cost_per_hr=3600.0, uptime_s=1.0,
               ssh=self.target, workdir=workdir)  # fmt: skip


def _nodes_config(tmp_path: Path, server: Sshd, remote_moetune: str, **over: Any) -> Path:
    at = f"127.0.0.1:{server.port}"
    return write_config(
        tmp_path, ssh={"hosts": [at, f"root@{at}"], "identity": str(server.identity)},
        workdir=str(tmp_path / "remote"), remote_moetune=remote_moetune,
        env={"HF_HUB_OFFLINE": "1", "HF_TOKEN": TOKEN}, **over,
    )  # fmt: skip


def test_two_ssh_nodes_each_run_their_rank_and_the_ledger_sums_both(
    tmp_path: Path, server: Sshd, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "fake-moetune"
    fake.write_text(FAKE_MOETUNE)
    fake.chmod(0o755)
    monkeypatch.setattr(SshProvider, "_pod", _billed)
    monkeypatch.chdir(tmp_path)
    config = _nodes_config(tmp_path, server, str(fake))
    got = CliRunner().invoke(app, ["launch", str(config), "--nnodes", "2", "--json"])
    assert got.exit_code == 0, got.output
    state = json.loads(got.stdout)
    assert state["finished"] and state["node_pods"] == [f"{state['pod_name']}-n1"]
    port = yaml.safe_load(config.read_text())["train"]["master_port"]
    for rank, pod in enumerate([state["pod_name"], *state["node_pods"]]):
        argv = (tmp_path / "remote" / pod / "argv.txt").read_text().splitlines()
        assert argv[:2] == ["train", "run.yaml"]
        flags = ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1"]
        assert argv[-9:-1] == [*flags, "--master-port", str(port)]
        assert argv[-1] == f"XET=1 TOKEN={TOKEN}"  # the walls' env and the secret, by env
        assert (tmp_path / "remote" / pod / "run.yaml").is_file()  # staged on every node
        assert (tmp_path / "remote" / pod / "deadman.log").is_file()  # guarded on every node
    banked = tmp_path / "runs" / "lane" / "adapter" / "adapter_model.safetensors"
    assert banked.read_text() == "weights\n"  # from node 0
    rows = Ledger(tmp_path / ".moetune" / "ledger.jsonl").read().rows
    provisioned = [r.metrics["pod_id"] for r in rows if r.kind == "provision"]
    assert provisioned == [state["pod_name"], *state["node_pods"]]
    (teardown,) = [r for r in rows if r.kind == "teardown"]
    assert teardown.cost_usd == pytest.approx(2.0) and teardown.metrics["nodes"] == 2
    assert teardown.metrics["node_pods"] == state["node_pods"]
    assert TOKEN not in (tmp_path / ".moetune" / "ledger.jsonl").read_text()


def test_a_failing_worker_ends_the_run_and_every_node_is_torn_down(
    tmp_path: Path, server: Sshd, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "fake-moetune"
    node_1_fails = 'if [[ " $* " == *" --node-rank 1 "* ]]; then echo rendezvous lost; exit 3; fi'
    fake.write_text(f"#!/bin/bash\n{node_1_fails}\nsleep 30\n")
    fake.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    config = _nodes_config(tmp_path, server, str(fake))
    got = CliRunner().invoke(app, ["launch", str(config), "--nnodes", "2"])
    assert got.exit_code != 0 and "train failed on node 1" in got.output
    assert "rendezvous lost" in got.output
    rows = Ledger(tmp_path / ".moetune" / "ledger.jsonl").read().rows
    assert [r.status for r in rows if r.kind == "launch"] == ["infra-failed"]
    assert [r.status for r in rows if r.kind == "teardown"] == ["ok"]
    for pod in (tmp_path / "remote").iterdir():  # node 0's sleep ended by teardown
        jobs = list((pod / ".moetune" / "jobs").glob("*.pid"))
        assert jobs == [], jobs


@pytest.mark.slow
def test_two_ssh_nodes_train_one_adapter_end_to_end(
    tmp_path: Path, server: Sshd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real `moetune train` on both nodes: a gloo world of 2 over loopback, node 0 writes
    the adapter, which is banked here."""
    src = Path(__file__).resolve().parents[1] / "src"
    env = f"env PYTHONPATH={shlex.quote(str(src))} OMP_NUM_THREADS=1"
    moetune = f"{env} {sys.executable} -m moetune"
    monkeypatch.chdir(tmp_path)
    config = _nodes_config(tmp_path, server, moetune)
    got = CliRunner().invoke(app, ["launch", str(config), "--nnodes", "2", "--json"])
    assert got.exit_code == 0, got.output
    state = json.loads(got.stdout)
    adapter = tmp_path / "runs" / "lane" / "adapter" / "adapter_model.safetensors"
    assert adapter.is_file() and state["banked"]["dir"].endswith("adapter")
    summary = json.loads((tmp_path / "runs" / "lane" / "summary.json").read_text())
    assert summary["distributed"]["world_size"] == 2
