"""A local stand-in for RunPod's GraphQL API: the subset moetune's provider speaks over an
in-memory pod table, with fault injection (5xx, slow answers, lost create answers, pods
that never start, GraphQL errors).

Like a real GraphQL server it reads values only from `variables`; a query text that
carries a string literal is refused, so a test fails if a client ever formats a value into
its query. Every request is recorded (operation, variables, query) for assertions. Time is
`time.time()` plus `advance()`d seconds, so uptime and spend can be checked exactly.
"""

from __future__ import annotations

import json
import random
import re
import string
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_FIRST_FIELD = re.compile(r"\{\s*(\w+)")


def operation(query: str) -> str:
    """The first field of the top-level selection (`pod`, `myself`, `podTerminate`, …)."""
    m = _FIRST_FIELD.search(query)
    return m[1] if m else ""


@dataclass
class FakePod:
    id: str
    name: str
    input: dict[str, Any]
    created: float
    cost_per_hr: float
    public_port: int
    desired: str = "RUNNING"
    polls: int = 0  # `pod` queries so far; the runtime appears after `ready_after` of them
    ready: bool = False
    stuck: bool = False
    foreign: bool = False
    gpu_util: list[float] = field(default_factory=lambda: [0.0])


@dataclass(frozen=True)
class Request:
    operation: str
    variables: dict[str, Any]
    query: str
    authorized: bool


@dataclass
class Fault:
    """What the next request matching `operation` (None: any) suffers."""

    operation: str | None = None
    status: int | None = None  # answer with this HTTP status
    drop: bool = False  # close the connection without an answer
    delay_s: float = 0.0  # answer this late
    commit: bool = False  # carry the operation out first (the answer is what gets lost)
    error: str | None = None  # answer 200 with this GraphQL error


class FakeRunpod:
    """`with FakeRunpod() as fake:` serves on `fake.url` until the block ends."""

    def __init__(
        self,
        api_key: str = "test-key",
        ready_after: int = 2,
        cost_per_hr: float = 3.59,
        ssh_host: str = "203.0.113.10",
        ssh_port: int | None = None,  # every pod's public 22/tcp (e.g. a test's real sshd)
    ) -> None:
        self.api_key = api_key
        self.ssh_port = ssh_port
        self.ready_after = ready_after
        self.cost_per_hr = cost_per_hr
        self.ssh_host = ssh_host
        self.reject_status = 401  # the answer to a wrong key
        self.stuck_starting = False  # pods created from now on never get a runtime
        self.missing = "null"  # a `pod` query for an unknown id: "null" data or an "error"
        self.pods: dict[str, FakePod] = {}
        self.requests: list[Request] = []
        self.faults: list[Fault] = []
        self.offset_s = 0.0
        self.lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.fake = self
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/graphql"

    def __enter__(self) -> FakeRunpod:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()

    # --- fault injection -------------------------------------------------------------

    def fail_next(self, count: int, status: int = 503, operation: str | None = None) -> None:
        self.faults += [Fault(operation, status=status) for _ in range(count)]

    def delay_next(self, count: int, seconds: float, operation: str | None = None) -> None:
        self.faults += [Fault(operation, delay_s=seconds, commit=True) for _ in range(count)]

    def lose_next_create(self, mode: str = "close") -> None:
        """The pod is created; then the connection closes ("close") or a 500 is sent."""
        drop, status = (True, None) if mode == "close" else (False, 500)
        self.faults.append(Fault("podFindAndDeployOnDemand", status, drop, commit=True))

    def fail_terminate(self, count: int, status: int = 502) -> None:
        self.fail_next(count, status, "podTerminate")

    def error_next(self, message: str, operation: str | None = None) -> None:
        self.faults.append(Fault(operation, error=message))

    # --- the pod table ----------------------------------------------------------------

    def now(self) -> float:
        return time.time() + self.offset_s

    def advance(self, seconds: float) -> None:
        self.offset_s += seconds

    def add_pod(self, name: str, running: bool = True, foreign: bool = True) -> FakePod:
        """A pod that exists before the test (someone else's unless `foreign=False`)."""
        with self.lock:
            pod = self._new_pod({"name": name, "gpuTypeId": "NVIDIA A100 80GB PCIe"})
            pod.ready, pod.foreign = running, foreign
            return pod

    def remove(self, pod_id: str) -> None:
        """The pod vanishes (terminated from the console, or by its own watchdog)."""
        with self.lock:
            self.pods.pop(pod_id, None)

    def named(self, name: str) -> list[FakePod]:
        return [p for p in self.pods.values() if p.name == name]

    def ops(self, name: str | None = None) -> list[Request]:
        return [r for r in self.requests if name is None or r.operation == name]

    # --- the GraphQL subset -----------------------------------------------------------

    def take_fault(self, op: str) -> Fault | None:
        with self.lock:
            for i, fault in enumerate(self.faults):
                if fault.operation in (None, op):
                    return self.faults.pop(i)
        return None

    def handle(self, op: str, query: str, variables: dict[str, Any]) -> dict[str, Any]:
        if '"' in query:
            return _error("fake RunPod: a string literal in the query; use variables")
        with self.lock:
            if op == "podFindAndDeployOnDemand":
                pod = self._new_pod(variables["input"])
                return {"data": {op: self._view(pod)}}
            if op == "pod":
                return self._pod_query(variables["input"]["podId"])
            if op == "podTerminate":
                return self._terminate(variables["input"]["podId"])
            if op == "myself":
                return {"data": {"myself": {"pods": [self._view(p) for p in self.pods.values()]}}}
        return _error(f"fake RunPod: unknown operation {op!r}")

    def _new_pod(self, spec: dict[str, Any]) -> FakePod:
        pod_id = "".join(random.choices(string.ascii_lowercase + string.digits, k=14))
        port = self.ssh_port or 10000 + len(self.pods) + len(self.requests)
        pod = FakePod(pod_id, spec["name"], spec, self.now(), self.cost_per_hr, port)
        pod.stuck = self.stuck_starting
        self.pods[pod_id] = pod
        return pod

    def _pod_query(self, pod_id: str) -> dict[str, Any]:
        pod = self.pods.get(pod_id)
        if pod is None:
            return _error("pod not found") if self.missing == "error" else {"data": {"pod": None}}
        pod.polls += 1
        if pod.polls >= self.ready_after and not pod.stuck:
            pod.ready = True
        return {"data": {"pod": self._view(pod)}}

    def _terminate(self, pod_id: str) -> dict[str, Any]:
        if self.pods.pop(pod_id, None) is None:
            return _error(f"Pod not found: {pod_id}")
        return {"data": {"podTerminate": None}}

    def _view(self, pod: FakePod) -> dict[str, Any]:
        runtime = None
        if pod.ready:
            runtime = {
                "uptimeInSeconds": int(self.now() - pod.created),
                "ports": [
                    {"ip": "10.0.0.2", "isIpPublic": False, "privatePort": 22,
                     "publicPort": 22, "type": "tcp"},
                    {"ip": self.ssh_host, "isIpPublic": True, "privatePort": 22,
                     "publicPort": pod.public_port, "type": "tcp"},
                ],
                "gpus": [
                    {"id": f"GPU-{i}", "gpuUtilPercent": u, "memoryUtilPercent": 0}
                    for i, u in enumerate(pod.gpu_util)
                ],
            }  # fmt: skip
        return {
            "id": pod.id,
            "name": pod.name,
            "desiredStatus": pod.desired,
            "costPerHr": pod.cost_per_hr,
            "runtime": runtime,
        }


def _error(message: str) -> dict[str, Any]:
    return {"data": None, "errors": [{"message": message}]}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    fake: FakeRunpod


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_POST(self) -> None:
        fake = self.server.fake
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        query, variables = body.get("query", ""), body.get("variables") or {}
        op = operation(query)
        authorized = self.headers.get("Authorization") == f"Bearer {fake.api_key}"
        with fake.lock:
            fake.requests.append(Request(op, variables, query, authorized))
        if not authorized:
            return self._reply(fake.reject_status, _error("Unauthorized"))
        fault = fake.take_fault(op)
        if fault is not None and not fault.commit:
            return self._suffer(fault)
        answer = fake.handle(op, query, variables)
        if fault is not None:
            return self._suffer(fault, answer)
        self._reply(200, answer)

    def _suffer(self, fault: Fault, answer: dict[str, Any] | None = None) -> None:
        time.sleep(fault.delay_s)
        if fault.drop:
            self.close_connection = True  # no status line: the client sees a dropped answer
        elif fault.error is not None:
            self._reply(200, _error(fault.error))
        elif fault.status is not None:
            self._reply(fault.status, {"errors": [{"message": "upstream trouble"}]})
        else:
            self._reply(200, answer or {})

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (its timeout) before a delayed answer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output clean
