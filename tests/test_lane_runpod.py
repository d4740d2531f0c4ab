"""Provider `runpod` against a local fake of RunPod's GraphQL API (tests/fake_runpod.py):
lifecycle, retries, idempotent create, idempotent terminate, variables-only queries, and
an API key that never leaks."""

from __future__ import annotations

import logging
import os
import subprocess
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import moetune.lane.providers.runpod as runpod_module
from fake_runpod import FakeRunpod
from moetune.config import LaneArgs, RunpodArgs
from moetune.lane.providers.base import (
    PROVIDERS,
    ExecResult,
    LaneError,
    PodGone,
    PodSpec,
    SshTarget,
    TransientError,
)
from moetune.lane.providers.runpod import (
    CREATE_POD,
    GET_POD,
    LIST_PODS,
    TERMINATE_POD,
    RunpodClient,
    RunpodProvider,
    api_key,
)

KEY = "rpa_PLANTED_SECRET_0123456789abcdefXYZ"
SPEC = PodSpec(
    name="moetune-run1-a1b2",
    gpu_type_id="NVIDIA H200",
    volume_gb=200,
    container_disk_gb=40,
    env={"HF_HUB_DISABLE_XET": "1"},
    cloud_type="SECURE",
)
CREATE = "podFindAndDeployOnDemand"


@pytest.fixture
def fake() -> Iterator[FakeRunpod]:
    with FakeRunpod(api_key=KEY, ready_after=2) as server:
        yield server


def client_for(url: str, key: str = KEY, timeout_s: float = 2.0, retries: int = 3) -> RunpodClient:
    return RunpodClient(url, key, timeout_s=timeout_s, retries=retries, backoff_s=0.005)


@pytest.fixture
def provider(fake: FakeRunpod, tmp_path: Path) -> RunpodProvider:
    return RunpodProvider(client_for(fake.url), tmp_path / "known_hosts", poll_s=0.01)


# --- lifecycle ----------------------------------------------------------------------


def test_create_wait_status_list_terminate(fake: FakeRunpod, provider: RunpodProvider) -> None:
    pod = provider.create(SPEC)
    assert (pod.name, pod.status, pod.ssh) == (SPEC.name, "starting", None)
    sent = fake.ops(CREATE)[0].variables["input"]
    assert sent == {
        "name": SPEC.name,
        "imageName": SPEC.image,
        "gpuTypeId": "NVIDIA H200",
        "gpuCount": 1,
        "volumeInGb": 200,
        "containerDiskInGb": 40,
        "volumeMountPath": "/workspace",
        "env": [{"key": "HF_HUB_DISABLE_XET", "value": "1"}],
        "ports": "22/tcp",
        "cloudType": "SECURE",
        "supportPublicIp": True,
        "startSsh": True,
    }
    ready = provider.wait_ready(pod.id, timeout_s=5)
    port = fake.pods[pod.id].public_port
    assert ready.ssh == SshTarget("203.0.113.10", port, "root")  # the public one, not 10.0.0.2
    assert (ready.status, ready.workdir) == ("running", "/workspace/moetune-runs")

    fake.pods[pod.id].gpu_util = [10.0, 30.0]
    fake.advance(1800)
    now = provider.status(pod.id)
    assert now.uptime_s >= 1800 and now.gpu_util_percent == 20.0
    assert now.spent_usd == pytest.approx(3.59 / 2, rel=0.01)
    assert [p.id for p in provider.list()] == [pod.id]

    provider.terminate(pod.id)
    assert fake.pods == {} and provider.list() == []
    with pytest.raises(PodGone, match=pod.id):
        provider.status(pod.id)


def test_list_maps_status_and_includes_foreign_pods(
    fake: FakeRunpod, provider: RunpodProvider
) -> None:
    fake.add_pod("someone-elses-notebook")
    fake.add_pod("still-booting", running=False)
    fake.add_pod("stopped").desired = "EXITED"
    fake.add_pod("going").desired = "TERMINATED"
    got = {p.name: p.status for p in provider.list()}
    assert got == {
        "someone-elses-notebook": "running",
        "still-booting": "starting",
        "stopped": "exited",
        "going": "terminated",
    }


def test_wait_ready_on_a_stuck_pod_names_it_and_the_reap_command(
    fake: FakeRunpod, provider: RunpodProvider
) -> None:
    fake.stuck_starting = True
    pod = provider.create(SPEC)
    with pytest.raises(LaneError) as err:
        provider.wait_ready(pod.id, timeout_s=0.2)
    assert pod.id in str(err.value) and f"moetune pods reap {pod.id}" in str(err.value)
    assert not isinstance(err.value, TransientError)
    assert len(fake.ops("pod")) >= 2  # it polled until the deadline


def test_wait_ready_on_a_vanished_pod_is_pod_gone(
    fake: FakeRunpod, provider: RunpodProvider
) -> None:
    pod = provider.create(SPEC)
    fake.remove(pod.id)
    with pytest.raises(PodGone, match=pod.id):
        provider.wait_ready(pod.id, timeout_s=5)


def test_wait_ready_rides_out_an_api_outage(fake: FakeRunpod, provider: RunpodProvider) -> None:
    pod = provider.create(SPEC)
    fake.fail_next(6, 503, "pod")  # more than one call's retry budget (3 retries)
    assert provider.wait_ready(pod.id, timeout_s=5).ssh is not None


# --- retries ------------------------------------------------------------------------


@pytest.mark.parametrize("status", [500, 502, 503, 429])
def test_transient_http_errors_are_retried(fake: FakeRunpod, status: int) -> None:
    fake.add_pod("x")
    fake.fail_next(3, status)
    assert len(RunpodProvider(client_for(fake.url), Path("kh")).list()) == 1
    assert len(fake.ops("myself")) == 4


def test_timeouts_are_retried(fake: FakeRunpod) -> None:
    fake.add_pod("x")
    fake.delay_next(2, 1.0)
    provider = RunpodProvider(client_for(fake.url, timeout_s=0.5), Path("kh"))
    assert [p.name for p in provider.list()] == ["x"]
    assert len(fake.ops("myself")) == 3


def test_exhausted_retries_raise_transient_error(fake: FakeRunpod) -> None:
    fake.fail_next(10, 502)
    provider = RunpodProvider(client_for(fake.url, retries=2), Path("kh"))
    with pytest.raises(TransientError, match=r"HTTP 502 \(after 3 tries\)"):
        provider.list()
    assert len(fake.ops()) == 3


def test_unreachable_api_is_transient(fake: FakeRunpod) -> None:
    fake.stop()
    with pytest.raises(TransientError, match="unreachable"):
        RunpodProvider(client_for(fake.url, retries=1), Path("kh")).list()


def test_graphql_errors_are_lane_errors_with_the_servers_message(
    fake: FakeRunpod, provider: RunpodProvider
) -> None:
    fake.error_next("There are no longer any instances available", CREATE)
    with pytest.raises(LaneError, match="no longer any instances") as err:
        provider.create(SPEC)
    assert not isinstance(err.value, TransientError)
    assert fake.pods == {}


def test_rejected_key_names_the_setting(fake: FakeRunpod, tmp_path: Path) -> None:
    provider = RunpodProvider(client_for(fake.url, key="wrong"), tmp_path / "kh")
    with pytest.raises(LaneError, match="RunPod rejected the API key") as err:
        provider.list()
    assert "lane.runpod.api_key_env" in str(err.value)
    assert len(fake.ops()) == 1  # a bad key is not retried


# --- create is idempotent by name ---------------------------------------------------


@pytest.mark.parametrize("mode", ["close", "500", "timeout"])
def test_lost_create_answer_adopts_the_pod(fake: FakeRunpod, tmp_path: Path, mode: str) -> None:
    if mode == "timeout":
        fake.delay_next(1, 0.6, CREATE)
    else:
        fake.lose_next_create(mode)
    provider = RunpodProvider(client_for(fake.url, timeout_s=0.3), tmp_path / "kh")
    pod = provider.create(SPEC)
    assert [p.id for p in fake.named(SPEC.name)] == [pod.id]
    assert len(fake.ops(CREATE)) == 1


def test_create_retries_when_nothing_was_created(
    fake: FakeRunpod, provider: RunpodProvider
) -> None:
    fake.fail_next(2, 503, CREATE)
    pod = provider.create(SPEC)
    assert [p.id for p in fake.named(SPEC.name)] == [pod.id]
    assert len(fake.ops(CREATE)) == 3
    assert provider.create(SPEC).id == pod.id  # a second create adopts too
    assert len(fake.ops(CREATE)) == 3


def test_create_gives_up_without_renting(fake: FakeRunpod, provider: RunpodProvider) -> None:
    fake.fail_next(20, 503, CREATE)
    with pytest.raises(TransientError, match=f"no pod named {SPEC.name} exists"):
        provider.create(SPEC)
    assert fake.pods == {} and len(fake.ops(CREATE)) == 4


def test_create_adopts_only_an_exact_name(fake: FakeRunpod, provider: RunpodProvider) -> None:
    foreign = [fake.add_pod(SPEC.name + "-old").id, fake.add_pod("moetune-run1").id]
    fake.add_pod(SPEC.name).desired = "TERMINATED"  # gone pods are not adopted
    pod = provider.create(SPEC)
    assert pod.id not in foreign and len(fake.ops(CREATE)) == 1
    assert all(fid in fake.pods for fid in foreign)


def test_create_needs_a_gpu_type(provider: RunpodProvider) -> None:
    with pytest.raises(LaneError, match="GPU type"):
        provider.create(PodSpec(name="n"))


def test_identity_public_key_is_sent(fake: FakeRunpod, tmp_path: Path) -> None:
    identity = tmp_path / "id_ed25519"
    identity.write_text("private")
    Path(f"{identity}.pub").write_text("ssh-ed25519 AAAA test@host\n")
    provider = RunpodProvider(client_for(fake.url), tmp_path / "kh", identity=identity)
    provider.create(SPEC)
    env = fake.ops(CREATE)[0].variables["input"]["env"]
    assert {"key": "PUBLIC_KEY", "value": "ssh-ed25519 AAAA test@host"} in env


# --- terminate is idempotent --------------------------------------------------------


def test_terminate_retries_5xx_and_is_idempotent(
    fake: FakeRunpod, provider: RunpodProvider
) -> None:
    pod = provider.create(SPEC)
    fake.fail_terminate(2, 502)
    provider.terminate(pod.id)
    assert pod.id not in fake.pods and len(fake.ops("podTerminate")) == 3
    provider.terminate(pod.id)  # already gone: success
    provider.terminate("no-such-pod")


def test_terminate_unknown_pod_when_the_query_errors(
    fake: FakeRunpod, provider: RunpodProvider
) -> None:
    fake.missing = "error"
    provider.terminate("no-such-pod")
    with pytest.raises(PodGone):
        provider.status("no-such-pod")


def test_terminate_error_on_a_live_pod_is_raised(
    fake: FakeRunpod, provider: RunpodProvider
) -> None:
    pod = provider.create(SPEC)
    fake.error_next("permission denied", "podTerminate")
    with pytest.raises(LaneError, match="permission denied"):
        provider.terminate(pod.id)


def test_self_terminate_command_ends_the_pod_with_its_own_key(
    fake: FakeRunpod, provider: RunpodProvider
) -> None:
    pod = provider.create(SPEC)
    command = provider.self_terminate_command(pod.id)
    assert KEY not in command and "$RUNPOD_API_KEY" in command
    env = {"PATH": os.environ["PATH"], "RUNPOD_API_KEY": KEY, "RUNPOD_POD_ID": pod.id}
    done = subprocess.run(["sh", "-c", command], env=env, timeout=60, capture_output=True)
    assert done.returncode == 0, done.stderr
    assert pod.id not in fake.pods
    assert fake.ops("podTerminate")[0].query == TERMINATE_POD
    with pytest.raises(LaneError):
        provider.self_terminate_command("x'; rm -rf /")


# --- values travel only as variables ------------------------------------------------

HOSTILE = [
    "quote \" and ' both",
    "new\nline\r\n",
    "back\\slash\\",
    '"}',
    '") { podTerminate(input:{podId:"x"}) }',
    "$input ${HOME} `id` ☃ \t\u0000",
]


def test_hostile_values_arrive_byte_exact_and_queries_are_constant(
    fake: FakeRunpod, provider: RunpodProvider
) -> None:
    bystander = fake.add_pod("x").id
    name = "moetune-" + "".join(HOSTILE)
    env = {f"K{i}": v for i, v in enumerate(HOSTILE)}
    pod = provider.create(PodSpec(name=name, gpu_type_id="NVIDIA H200", env=env))
    sent = fake.ops(CREATE)[0].variables["input"]
    assert sent["name"] == name
    assert sent["env"] == [{"key": k, "value": v} for k, v in env.items()]
    assert provider.create(PodSpec(name=name, gpu_type_id="NVIDIA H200")).id == pod.id
    for hostile in HOSTILE:
        with pytest.raises(PodGone):
            provider.status(hostile)
        provider.terminate(hostile)
    assert [r.variables["input"]["podId"] for r in fake.ops("podTerminate")] == HOSTILE
    assert set(fake.pods) == {bystander, pod.id}
    assert {r.query for r in fake.ops()} == {CREATE_POD, GET_POD, LIST_PODS, TERMINATE_POD}
    assert all('"' not in q for q in (CREATE_POD, GET_POD, LIST_PODS, TERMINATE_POD))


# --- the API key never leaks --------------------------------------------------------


def _error_paths(fake: FakeRunpod, tmp_path: Path) -> list[LaneError]:
    """Drive every failure the client knows; the errors it raised."""
    kh = tmp_path / "kh"
    fast = RunpodProvider(client_for(fake.url, timeout_s=0.2, retries=1), kh, poll_s=0.01)
    errors: list[LaneError] = []

    def expect(run: Callable[[], object]) -> None:
        with pytest.raises(LaneError) as err:
            run()
        errors.append(err.value)
        fake.faults.clear()

    fake.fail_next(2, 503)
    expect(fast.list)
    fake.delay_next(2, 0.5)
    expect(fast.list)
    fake.error_next(f"invalid token {KEY} for user")
    expect(fast.list)
    fake.fail_next(20, 500, CREATE)
    expect(lambda: fast.create(SPEC))
    fake.stuck_starting = True
    expect(lambda: fast.wait_ready(fast.create(PodSpec("s", gpu_type_id="G")).id, 0.1))
    fake.reject_status = 403
    expect(RunpodProvider(client_for(fake.url, key=KEY + "-revoked"), kh).list)
    fake.reject_status = 401
    expect(RunpodProvider(client_for(fake.url, key=KEY[:-1]), kh).list)
    fake.stop()
    expect(fast.list)
    return errors


def test_the_api_key_never_leaks(
    fake: FakeRunpod,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)
    client = client_for(fake.url)
    provider = RunpodProvider(client, tmp_path / "kh")
    errors = _error_paths(fake, tmp_path)
    assert len(errors) == 8
    assert any("<redacted>" in str(e) for e in errors)  # the echoed key was scrubbed
    texts = [repr(client), repr(provider), caplog.text, *capsys.readouterr()]
    texts += [m for r in caplog.records for m in (r.getMessage(), str(r.args))]
    for exc in errors:
        texts += [str(exc), repr(exc), "".join(traceback.format_exception(exc))]
    for leaked_part in (KEY, KEY[:-1]):
        assert not [t for t in texts if leaked_part in t]


# --- key resolution, config, SSH delegation -----------------------------------------


def test_api_key_prefers_the_env_then_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.toml"
    args = RunpodArgs(api_key_env="MT_TEST_RUNPOD_KEY", config_file=str(path))
    monkeypatch.setenv("MT_TEST_RUNPOD_KEY", "from-env")
    path.write_text('apikey = "from-file"\napiurl = "https://api.runpod.io/graphql"\n')
    assert api_key(args) == "from-env"
    monkeypatch.setenv("MT_TEST_RUNPOD_KEY", "  ")  # blank counts as unset
    assert api_key(args) == "from-file"
    path.write_text('[default]\napi_key = "from-sdk-profile"\n')
    assert api_key(args) == "from-sdk-profile"


def test_api_key_missing_or_unreadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MT_TEST_RUNPOD_KEY", raising=False)
    path = tmp_path / "config.toml"
    args = RunpodArgs(api_key_env="MT_TEST_RUNPOD_KEY", config_file=str(path))
    with pytest.raises(LaneError) as err:
        api_key(args)
    assert "MT_TEST_RUNPOD_KEY" in str(err.value) and "lane.runpod.api_key_env" in err.value.fix
    assert str(path) in str(err.value)
    path.write_text('apikey = "unterminated\n')
    with pytest.raises(LaneError, match="not valid TOML"):
        api_key(args)


def test_api_key_file_without_tomllib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runpod_module, "tomllib", None)  # as on Python 3.10
    monkeypatch.delenv("MT_TEST_RUNPOD_KEY", raising=False)
    path = tmp_path / "config.toml"
    path.write_text('[default]\napi_key = "flat-parse"\n')
    assert api_key(RunpodArgs(api_key_env="MT_TEST_RUNPOD_KEY", config_file=str(path))) == (
        "flat-parse"
    )


def test_from_config_is_registered_and_places_the_workdir_on_the_volume(
    fake: FakeRunpod, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MT_TEST_RUNPOD_KEY", KEY)
    runpod = RunpodArgs(api_key_env="MT_TEST_RUNPOD_KEY", api_url=fake.url)
    lane = LaneArgs(provider="runpod", runpod=runpod)
    provider = PROVIDERS.get("runpod").from_config(lane, tmp_path)
    assert isinstance(provider, RunpodProvider)
    assert (provider.workdir, provider.known_hosts) == (
        "/workspace/moetune-runs",
        tmp_path / "known_hosts",
    )
    assert provider.list() == []
    assert KEY not in repr(provider.client)


def test_exec_and_copies_go_through_ssh_to_the_public_port(
    fake: FakeRunpod, provider: RunpodProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[object, ...]] = []

    class StubTransport:
        def __init__(self, *args: object) -> None:
            calls.append(("new", *args))

        def exec(self, command: str, timeout_s: float | None, env: object = None) -> ExecResult:
            calls.append(("exec", command, timeout_s))
            return ExecResult(0, "ok\n", "")

        def copy_in(self, local: Path, remote: str) -> None:
            calls.append(("in", local, remote))

        def copy_out(self, remote: str, local: Path) -> None:
            calls.append(("out", remote, local))

    monkeypatch.setattr(runpod_module, "SshTransport", StubTransport)
    pod = provider.wait_ready(provider.create(SPEC).id, timeout_s=5)
    assert provider.exec(pod.id, "nvidia-smi", 10) == ExecResult(0, "ok\n", "")
    provider.copy_in(pod.id, Path("a"), "b")
    provider.copy_out(pod.id, "c", Path("d"))
    target = SshTarget("203.0.113.10", fake.pods[pod.id].public_port, "root")
    assert provider.known_hosts_for(pod.id).name == f"known_hosts.{pod.id}"
    assert calls == [
        ("new", target, None, provider.known_hosts_for(pod.id), "/workspace/moetune-runs"),
        ("exec", "nvidia-smi", 10),
        ("in", Path("a"), "b"),
        ("out", "c", Path("d")),
    ]
