"""Provider `runpod`: GPU pods rented through RunPod's GraphQL API, then used over SSH.

Every request sends a constant query text and carries user values (names, env, ids) only
in GraphQL variables: RunPod's own SDK formats them into the query, so a quote in a pod
name can rewrite its mutation. The API key travels in one header and is redacted from
every error, repr and log line. `create` is idempotent by name: when a create's answer is
lost (timeout, 5xx, dropped connection) the provider looks for a pod with exactly that
name before trying again, so a flaky network never rents a second GPU.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import time
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from moetune.errors import MoetuneError
from moetune.lane.providers.base import (
    Env,
    ExecResult,
    LaneError,
    Pod,
    PodGone,
    PodSpec,
    PodStatus,
    Provider,
    SshTarget,
    TransientError,
    register_provider,
)
from moetune.lane.providers.ssh import SshTransport
from moetune.plan.cost.walls import DEFAULT_WATCHDOG_S

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: _load_toml reads the flat lines itself
    tomllib = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from moetune.config import LaneArgs, RunpodArgs

log = logging.getLogger(__name__)

VOLUME_MOUNT = "/workspace"  # the pod volume: survives container restarts, unlike the disk
DEFAULT_WORKDIR = f"{VOLUME_MOUNT}/moetune-runs"
DEFAULT_VOLUME_GB = 40  # what a RunPod pod gets when volumeInGb is not set
SELF_TERMINATE_TRIES = 6
SELF_TERMINATE_PAUSE_S = 20

_POD_FIELDS = (
    "id name desiredStatus costPerHr runtime { uptimeInSeconds "
    "ports { ip isIpPublic privatePort publicPort type } "
    "gpus { id gpuUtilPercent memoryUtilPercent } }"
)
CREATE_POD = (
    "mutation CreatePod($input: PodFindAndDeployOnDemandInput!) "
    f"{{ podFindAndDeployOnDemand(input: $input) {{ {_POD_FIELDS} }} }}"
)
GET_POD = f"query Pod($input: PodFilter!) {{ pod(input: $input) {{ {_POD_FIELDS} }} }}"
LIST_PODS = f"query Pods {{ myself {{ pods {{ {_POD_FIELDS} }} }} }}"
TERMINATE_POD = "mutation TerminatePod($input: PodTerminateInput!) { podTerminate(input: $input) }"

# desiredStatus → Pod.status; RUNNING without a runtime is a container still starting
_STATUS: dict[str, PodStatus] = {
    "RUNNING": "running",
    "CREATED": "starting",
    "RESTARTING": "starting",
    "EXITED": "exited",
    "PAUSED": "exited",
    "TERMINATED": "terminated",
}
_NET_FIX = "check the network and https://uptime.runpod.io, then run the command again"
_KEY_FIX = (
    "put a valid key in the env var named by lane.runpod.api_key_env (default "
    "RUNPOD_API_KEY) or in lane.runpod.config_file"
)


class _Transport(Protocol):
    """What `ssh.SshTransport` offers (imported only when a pod is first used)."""

    def exec(self, command: str, timeout_s: float | None, env: Env | None) -> ExecResult: ...
    def copy_in(self, local: Path, remote: str) -> None: ...
    def copy_out(self, remote: str, local: Path) -> None: ...


class RunpodClient:
    """RunPod GraphQL over httpx; transient faults (5xx, 429, timeouts, dropped
    connections) are retried `retries` times with exponential backoff."""

    def __init__(
        self,
        api_url: str,
        api_key: str,
        timeout_s: float = 30.0,
        retries: int = 4,
        backoff_s: float = 2.0,
    ) -> None:
        self.api_url = api_url
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._key = api_key
        self._http = httpx.Client(
            timeout=timeout_s,
            headers={"Authorization": f"Bearer {api_key}", "User-Agent": "moetune"},
        )

    def __repr__(self) -> str:
        return f"RunpodClient(api_url={self.redact(self.api_url)!r}, api_key=<redacted>)"

    def close(self) -> None:
        self._http.close()

    def redact(self, text: str) -> str:
        return text.replace(self._key, "<redacted>") if self._key else text

    def pause(self, attempt: int) -> None:
        """Sleep before try `attempt + 2` (doubling, capped at a minute)."""
        time.sleep(min(self.backoff_s * 2**attempt, 60.0))

    def call(
        self, query: str, variables: dict[str, Any] | None = None, *, retry: bool = True
    ) -> dict[str, Any]:
        """Run one operation; its `data`. `retry=False` is for the non-idempotent create."""
        tries = self.retries + 1 if retry else 1
        for attempt in range(tries - 1):
            try:
                return self._once(query, variables or {})
            except TransientError as exc:
                log.warning("RunPod API: %s; retry %d of %d", exc.cause, attempt + 1, tries - 1)
                self.pause(attempt)
        try:
            return self._once(query, variables or {})
        except TransientError as exc:
            raise TransientError(f"{exc.cause} (after {tries} tries)", exc.fix) from None

    def _once(self, query: str, variables: dict[str, Any]) -> dict[str, Any]:
        try:
            answer = self._http.post(self.api_url, json={"query": query, "variables": variables})
        except httpx.TimeoutException:
            cause = f"RunPod API did not answer within {self.timeout_s:g} s"
            raise TransientError(cause, _NET_FIX) from None
        except httpx.TransportError as exc:  # refused, reset, closed without an answer
            cause = f"RunPod API unreachable ({type(exc).__name__}: {self.redact(str(exc))})"
            raise TransientError(cause, _NET_FIX) from None
        return self._data(answer)

    def _data(self, answer: httpx.Response) -> dict[str, Any]:
        code = answer.status_code
        if code in (401, 403):
            raise LaneError(f"RunPod rejected the API key (HTTP {code}).", _KEY_FIX)
        if code == 429 or code >= 500:
            raise TransientError(f"RunPod API answered HTTP {code}", _NET_FIX)
        try:
            body = answer.json()
        except ValueError:
            cause = f"RunPod API sent an unreadable answer (HTTP {code})"
            raise TransientError(cause, _NET_FIX) from None
        if not isinstance(body, dict):
            raise LaneError(f"RunPod API sent an unexpected answer (HTTP {code})", _NET_FIX)
        if body.get("errors"):
            errors = body["errors"] if isinstance(body["errors"], list) else [body["errors"]]
            messages = "; ".join(
                str(e.get("message", e) if isinstance(e, dict) else e) for e in errors
            )
            cause = f"RunPod API error: {self.redact(messages)[:500]}"
            raise LaneError(cause, "check the pod settings in lane.runpod and the RunPod console")
        if code != 200 or not isinstance(body.get("data"), dict):
            raise LaneError(f"RunPod API sent no data (HTTP {code})", _NET_FIX)
        return body["data"]


def api_key(args: RunpodArgs) -> str:
    """The key from the env var named by `api_key_env`, else from `config_file`."""
    key = os.environ.get(args.api_key_env, "").strip()
    if key:
        return key
    path = Path(args.config_file).expanduser()
    key = _key_from_file(path) if path.is_file() else ""
    if key:
        return key
    raise LaneError(
        f"No RunPod API key: ${args.api_key_env} is unset and {path} holds none.",
        f"export {args.api_key_env}=<key> (the name is lane.runpod.api_key_env), or run "
        f"`runpodctl config --apiKey <key>`, which writes {path} (lane.runpod.config_file)",
    )


def _key_from_file(path: Path) -> str:
    """`apikey` (runpodctl), `api_key`, or `[default] api_key` (the runpod SDK's CLI)."""
    try:
        data = _load_toml(path.read_text())
    except ValueError as exc:  # TOMLDecodeError: its message holds a position, not the text
        raise LaneError(f"{path} is not valid TOML ({exc}).", "fix or delete the file") from None
    default = data.get("default")
    nested = default.get("api_key") if isinstance(default, dict) else None
    key = data.get("apikey") or data.get("api_key") or nested
    return key.strip() if isinstance(key, str) else ""


def _load_toml(text: str) -> dict[str, Any]:
    if tomllib is None:  # Python 3.10: the flat `key = "value"` lines these files hold
        pairs = re.finditer(r'(?m)^\s*([A-Za-z_]+)\s*=\s*"([^"\n]*)"\s*$', text)
        return {m[1]: m[2] for m in pairs}
    return tomllib.loads(text)


@register_provider("runpod")
class RunpodProvider(Provider):
    """RunPod pods: lifecycle through the API, `exec`/`copy_*` over SSH to the public port."""

    id_pattern = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # RunPod: e.g. "x7k2m9p4q1w8e3"
    title = "RunPod"
    default_volume_gb = DEFAULT_VOLUME_GB
    default_watchdog_s = DEFAULT_WATCHDOG_S

    def __init__(
        self,
        client: RunpodClient,
        known_hosts: Path,
        identity: Path | None = None,
        workdir: str = DEFAULT_WORKDIR,
        poll_s: float = 5.0,
    ) -> None:
        self.client = client
        self.known_hosts = known_hosts
        self.identity = identity
        self.workdir = workdir
        self.poll_s = poll_s
        self._transports: dict[str, _Transport] = {}

    @classmethod
    def from_config(cls, lane: LaneArgs, state_dir: Path) -> RunpodProvider:
        """From the run config; the host keys of the run's pods are pinned in `state_dir`."""
        identity = Path(lane.ssh.identity).expanduser() if lane.ssh.identity else None
        workdir = lane.workdir if lane.workdir.startswith("/") else f"{VOLUME_MOUNT}/{lane.workdir}"
        client = RunpodClient(lane.runpod.api_url, api_key(lane.runpod))
        return cls(client, state_dir / "known_hosts", identity=identity, workdir=workdir)

    @classmethod
    def secret_names(cls, lane: LaneArgs) -> dict[str, str]:
        return {lane.runpod.api_key_env: "lane.runpod.api_key_env"}

    @classmethod
    def secret_values(cls, lane: LaneArgs) -> list[str]:
        with suppress(MoetuneError):  # no key here: nothing of it to mask
            return [api_key(lane.runpod)]
        return []

    def create(self, spec: PodSpec) -> Pod:
        payload = {"input": self._deploy_input(spec)}
        tries = self.client.retries + 1
        last = TransientError("RunPod create was not tried")
        for attempt in range(tries + 1):  # the extra round only looks: did the last one land?
            if attempt:
                self.client.pause(attempt - 1)
            found = self._find(spec.name)
            if found is not None:
                log.info("adopting RunPod pod %s named %s", found.id, spec.name)
                return found
            if attempt == tries:
                break
            try:
                data = self.client.call(CREATE_POD, payload, retry=False)
            except TransientError as exc:
                last = exc
                continue
            return self._created(data)
        cause = f"{last.cause} (create tried {tries} times; no pod named {spec.name} exists)"
        raise TransientError(cause, last.fix)

    def wait_ready(self, pod_id: str, timeout_s: float) -> Pod:
        deadline = time.monotonic() + timeout_s
        pod: Pod | None = None
        while True:
            try:
                pod = self.status(pod_id)
            except TransientError as exc:  # an API blip mid-wait is not a failed pod
                log.warning("RunPod status of %s: %s", pod_id, exc.cause)
            if pod is not None and pod.ssh is not None:
                return pod
            if pod is not None and pod.status == "exited":
                raise LaneError(f"RunPod pod {pod_id} exited before SSH opened.", _reap(pod_id))
            left = deadline - time.monotonic()
            if left <= 0:
                seen = pod.status if pod is not None else "unknown"
                cause = (
                    f"RunPod pod {pod_id} opened no public SSH port in {timeout_s:g} s ({seen})."
                )
                raise LaneError(cause, f"{_reap(pod_id)}; or raise lane.ready_timeout_s")
            time.sleep(min(self.poll_s, left))

    def status(self, pod_id: str) -> Pod:
        raw = self._get(pod_id)
        if raw is None or _status(raw) == "terminated":
            raise PodGone(f"RunPod pod {pod_id} no longer exists.", "launch again or --resume")
        return self._pod(raw)

    def exec(
        self, pod_id: str, command: str, timeout_s: float | None = None, env: Env | None = None
    ) -> ExecResult:
        try:
            return self._transport(pod_id).exec(command, timeout_s, env)
        except TransientError:
            self._transports.pop(pod_id, None)  # a restarted pod may have a new public port
            raise

    def copy_in(self, pod_id: str, local: Path, remote: str) -> None:
        try:
            self._transport(pod_id).copy_in(local, remote)
        except TransientError:
            self._transports.pop(pod_id, None)
            raise

    def copy_out(self, pod_id: str, remote: str, local: Path) -> None:
        try:
            self._transport(pod_id).copy_out(remote, local)
        except TransientError:
            self._transports.pop(pod_id, None)
            raise

    def terminate(self, pod_id: str) -> None:
        self._transports.pop(pod_id, None)
        try:
            self.client.call(TERMINATE_POD, {"input": {"podId": pod_id}})
        except TransientError:
            raise
        except LaneError:  # "not found" wording is not documented: ask whether it exists
            raw = self._get(pod_id)
            if raw is not None and _status(raw) != "terminated":
                raise

    def list(self) -> list[Pod]:
        return [self._pod(raw) for raw in _raw_pods(self.client)]

    def self_terminate_command(self, pod_id: str) -> str:
        """POSIX shell that terminates the pod it runs in with the pod's own scoped key
        (`$RUNPOD_API_KEY`, `$RUNPOD_POD_ID`, set by RunPod); no key text is embedded."""
        pod_id = _safe_id(pod_id)
        body = json.dumps({"query": TERMINATE_POD, "variables": {"input": {"podId": "@ID@"}}})
        head, tail = body.split("@ID@")
        data = f'{shlex.quote(head)}"$pod"{shlex.quote(tail)}'
        curl = (
            f"curl -fsS --max-time 30 -X POST {shlex.quote(self.client.api_url)} "
            "-H 'Content-Type: application/json' "
            f'-H "Authorization: Bearer $RUNPOD_API_KEY" --data {data}'
        )
        return (
            f'pod="${{RUNPOD_POD_ID:-{pod_id}}}"; i=0; '
            f"while [ $i -lt {SELF_TERMINATE_TRIES} ]; do i=$((i+1)); "
            f'out=$({curl}) && case "$out" in *\'"errors"\'*) ;; *) break;; esac; '
            f"sleep {SELF_TERMINATE_PAUSE_S}; done"
        )

    def _deploy_input(self, spec: PodSpec) -> dict[str, Any]:
        if not spec.gpu_type_id:
            raise LaneError(
                f"Pod {spec.name} has no RunPod GPU type.",
                "pick a card whose catalog entry has a RunPod id (e.g. NVIDIA H200)",
            )
        env = dict(spec.env)
        public_key = self._public_key()
        if public_key and "PUBLIC_KEY" not in env:  # RunPod images authorise it for root
            env["PUBLIC_KEY"] = public_key
        return {
            "name": spec.name,
            "imageName": spec.image,
            "gpuTypeId": spec.gpu_type_id,
            "gpuCount": spec.gpu_count,
            "volumeInGb": spec.volume_gb,
            "containerDiskInGb": spec.container_disk_gb,
            "volumeMountPath": VOLUME_MOUNT,
            "env": [{"key": k, "value": v} for k, v in env.items()],
            "ports": spec.ports,
            "cloudType": spec.cloud_type,
            "supportPublicIp": True,
            "startSsh": True,
        }

    def _public_key(self) -> str | None:
        if self.identity is None:
            return None  # the account's SSH keys (RunPod settings) apply
        pub = Path(f"{self.identity}.pub")
        return pub.read_text().strip() if pub.is_file() else None

    def _created(self, data: dict[str, Any]) -> Pod:
        raw = data.get("podFindAndDeployOnDemand")
        if not isinstance(raw, dict) or not raw.get("id"):
            raise LaneError("RunPod created no pod and said nothing.", "try another card or cloud")
        return self._pod(raw)

    def _find(self, name: str) -> Pod | None:
        """The live pod named exactly `name` (a name is unique per run attempt)."""
        for raw in _raw_pods(self.client):
            if raw.get("name") == name and _status(raw) != "terminated":
                return self._pod(raw)
        return None

    def _get(self, pod_id: str) -> dict[str, Any] | None:
        try:
            raw = self.client.call(GET_POD, {"input": {"podId": pod_id}}).get("pod")
        except TransientError:
            raise
        except LaneError as exc:
            if re.search(r"not\s*found|does not exist|no pod", exc.cause, re.IGNORECASE):
                return None
            raise
        return raw if isinstance(raw, dict) else None

    def _pod(self, raw: dict[str, Any]) -> Pod:
        runtime = raw.get("runtime") or {}
        return Pod(
            id=str(raw["id"]),
            name=str(raw.get("name") or ""),
            status=_status(raw),
            cost_per_hr=float(raw.get("costPerHr") or 0.0),
            uptime_s=float(runtime.get("uptimeInSeconds") or 0.0),
            gpu_util_percent=_mean_util(runtime.get("gpus") or []),
            ssh=_ssh_target(runtime.get("ports") or []),
            workdir=self.workdir,
        )

    def _transport(self, pod_id: str) -> _Transport:
        if pod_id not in self._transports:
            pod = self.status(pod_id)
            if pod.ssh is None:
                cause = f"RunPod pod {pod_id} has no public SSH port yet ({pod.status})."
                raise LaneError(cause, "wait for it to start, or " + _reap(pod_id))
            known_hosts = self.known_hosts_for(pod_id)
            transport = SshTransport(pod.ssh, self.identity, known_hosts, self.workdir)
            self._transports[pod_id] = transport
        return self._transports[pod_id]

    def known_hosts_for(self, pod_id: str) -> Path:
        """One pinned host key per pod: RunPod hands a public ip:port to another pod (and
        host key) after a pod ends, which a shared file would report as an attack."""
        return self.known_hosts.with_name(f"{self.known_hosts.name}.{_safe_id(pod_id)}")


def _raw_pods(client: RunpodClient) -> list[dict[str, Any]]:
    myself = client.call(LIST_PODS).get("myself")
    if not isinstance(myself, dict):
        raise LaneError("RunPod API returned no account for the key.", _KEY_FIX)
    return [p for p in myself.get("pods") or [] if isinstance(p, dict)]


def _status(raw: dict[str, Any]) -> PodStatus:
    status = _STATUS.get(str(raw.get("desiredStatus")), "unknown")
    return "starting" if status == "running" and not raw.get("runtime") else status


def _ssh_target(ports: list[dict[str, Any]]) -> SshTarget | None:
    for port in ports:
        if port.get("privatePort") == 22 and port.get("isIpPublic") and port.get("publicPort"):
            return SshTarget(str(port["ip"]), int(port["publicPort"]), "root")
    return None


def _mean_util(gpus: list[dict[str, Any]]) -> float | None:
    utils = [float(g["gpuUtilPercent"]) for g in gpus if g.get("gpuUtilPercent") is not None]
    return sum(utils) / len(utils) if utils else None


def _safe_id(pod_id: str) -> str:
    """`pod_id` if it can go into a file name or a shell word unquoted (RunPod ids can)."""
    if not re.fullmatch(r"[A-Za-z0-9_-]+", pod_id):
        raise LaneError(f"RunPod pod id {pod_id!r} has unexpected characters.", "check the id")
    return pod_id


def _reap(pod_id: str) -> str:
    return f"it is still billing: terminate it with `moetune pods reap {pod_id}`"
