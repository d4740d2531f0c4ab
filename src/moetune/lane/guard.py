"""The cost guard: the layers that keep a rented pod from billing after its work is done
(docs/knowledge.md §8).

In the pod: a dead-man switch armed first (sleep until the deadline, then terminate itself)
and a GPU-idle watchdog; both are plain POSIX sh, so they need nothing installed and keep
running when the controller's connection drops. On the controller: a budget checked at every
poll, and an orphan sweep that terminates only pods moetune recorded as its own, by id –
never by name, since anyone can name a pod `moetune-…`.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetune.lane.providers.base import LaneError, Pod, PodGone, Provider, TransientError
from moetune.ledger import Ledger, LedgerRow

GUARD_LOG = "moetune-guard.log"
TERMINATE_ATTEMPTS = 5  # the provider's API may be briefly down exactly at the deadline
TERMINATE_RETRY_S = 30
SMI_QUERY = "--query-gpu=utilization.gpu --format=csv,noheader,nounits"

# ---------------------------------------------------------------- in-pod scripts


def _prelude(who: str, terminate_cmd: str, log: str, attempts: int, retry_s: float) -> str:
    """Logging and a retried `terminate` shared by both scripts. No comments in the script
    text: providers wrap it in `( … )` on one line, where a trailing comment eats the `)`."""
    return f"""log={shlex.quote(log)}
say() {{ echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) {who}: $*" >> "$log"; }}
terminate() {{
  n=1
  while [ "$n" -le {attempts} ]; do
    say "terminate attempt $n"
    if sh -c {shlex.quote(terminate_cmd)} >> "$log" 2>&1; then say "terminated"; return 0; fi
    n=$((n + 1))
    [ "$n" -gt {attempts} ] || sleep {retry_s:g}
  done
  say "terminate failed {attempts} times; the controller's budget and sweep remain"
  return 1
}}
"""


def deadman_script(
    deadline_s: int,
    terminate_cmd: str,
    log: str = GUARD_LOG,
    attempts: int = TERMINATE_ATTEMPTS,
    retry_s: float = TERMINATE_RETRY_S,
) -> str:
    """POSIX sh that sleeps `deadline_s`, then runs `terminate_cmd` (retried), logging to
    `log`. Run it detached first thing on a pod: whatever fails later, the pod ends."""
    if deadline_s < 0:
        raise ValueError(f"deadline_s must be >= 0, got {deadline_s}")
    return _prelude("deadman", terminate_cmd, log, attempts, retry_s) + (
        f'say "armed: terminating this pod in {int(deadline_s)} s"\n'
        f"sleep {int(deadline_s)}\n"
        'say "deadline reached"\n'
        "terminate\n"
    )


def idle_watchdog_script(
    threshold_percent: float,
    minutes: float,
    terminate_cmd: str,
    poll_s: float = 60,
    smi: str = "nvidia-smi",
    log: str = GUARD_LOG,
    attempts: int = TERMINATE_ATTEMPTS,
    retry_s: float = TERMINATE_RETRY_S,
) -> str:
    """POSIX sh that polls GPU utilisation (the busiest GPU counts) every `poll_s` and runs
    `terminate_cmd` once it stayed below `threshold_percent` for `minutes`. Without `smi` it
    logs that and exits 0; a failed reading counts as not idle (the dead-man still holds)."""
    if poll_s <= 0 or minutes < 0:
        raise ValueError(f"need poll_s > 0 and minutes >= 0, got {poll_s}, {minutes}")
    limit = math.ceil(minutes * 60)
    # busiest GPU decides; "[N/A]" and other non-numbers are skipped
    classify = (
        f"awk -v t={threshold_percent:g} 'BEGIN {{ m = -1 }} "
        "$1 ~ /^[0-9.]+$/ && $1 + 0 > m { m = $1 + 0 } "
        'END { print (m < 0 ? "none" : (m < t ? "idle" : "busy")) }\''
    )
    return (
        _prelude("idle-watchdog", terminate_cmd, log, attempts, retry_s)
        + f"""smi={shlex.quote(smi)}
if ! command -v "$smi" >/dev/null 2>&1; then say "$smi not found: watchdog off"; exit 0; fi
say "armed: terminate after {limit} s under {threshold_percent:g} % GPU use"
since=""
last=""
while :; do
  state=$("$smi" {SMI_QUERY} 2>/dev/null | {classify})
  now=$(date +%s)
  [ "$state" = "$last" ] || say "GPU $state"
  last=$state
  if [ "$state" != idle ]; then
    since=""
  else
    [ -n "$since" ] || since=$now
    if [ $((now - since)) -ge {limit} ]; then
      say "idle for $((now - since)) s"
      terminate
      exit $?
    fi
  fi
  sleep {poll_s:g}
done
"""
    )


# ---------------------------------------------------------------- controller side


@dataclass(frozen=True)
class Budget:
    """A spend limit in USD over all of a run's pods; None means no limit."""

    max_usd: float | None

    def check(self, pods_spend_usd: float) -> bool:
        """True once the spend has reached the budget: time to bank, terminate, ledger."""
        return self.max_usd is not None and pods_spend_usd >= self.max_usd

    @staticmethod
    def spent(pod: Pod, extra_uptime_s: float = 0) -> float:
        """What the pod has cost, or will have after `extra_uptime_s` more (the next poll)."""
        return pod.cost_per_hr * (pod.uptime_s + extra_uptime_s) / 3600

    def remaining_s(self, pod: Pod, spent_elsewhere_usd: float = 0.0) -> float:
        """Seconds until the budget is reached at the pod's rate (inf without budget or rate);
        `spent_elsewhere_usd` is what earlier pods of the run already cost."""
        if self.max_usd is None or pod.cost_per_hr <= 0:
            return math.inf
        left = self.max_usd - spent_elsewhere_usd - self.spent(pod)
        return max(0.0, left / pod.cost_per_hr * 3600)


def sweep_targets(pods: list[Pod], own_ids: set[str], held_ids: set[str]) -> list[Pod]:
    """Pods safe to terminate: recorded by id as moetune's own, held by no live run, and not
    already gone. Names are never consulted."""
    return [
        p for p in pods if p.id in own_ids and p.id not in held_ids and p.status != "terminated"
    ]


def own_pod_ids(ledger_rows: Iterable[LedgerRow]) -> set[str]:
    """Ids of pods moetune created: the `pod_id` of every provision row."""
    ids = (r.metrics.get("pod_id") for r in ledger_rows if r.kind == "provision")
    return {i for i in ids if isinstance(i, str) and i}


def _lane_states(state_dir: Path) -> list[dict[str, Any]]:
    """Every readable `state_dir/*/state.json`; a torn or foreign file is skipped."""
    states = []
    for path in sorted(state_dir.glob("*/state.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and isinstance(doc.get("pod_id"), str) and doc["pod_id"]:
            states.append(doc)
    return states


def _alive(pid: Any) -> bool:
    # pid 0 / negative would signal process groups; a reused pid reads as alive, which only
    # ever spares a pod (safe), never reaps one
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OverflowError:
        return False
    return True


def _pods_of(state: dict[str, Any]) -> set[str]:
    """A launch's pods: node 0's and, on several nodes, every other node's."""
    nodes = state.get("node_pods")
    others = {p for p in nodes if isinstance(p, str) and p} if isinstance(nodes, list) else set()
    return {state["pod_id"], *others}


def held_pod_ids(state_dir: Path) -> set[str]:
    """Pods a live, unfinished launch on this machine still uses: never swept."""
    live = (s for s in _lane_states(state_dir) if not s.get("finished") and _alive(s.get("pid")))
    return {pod for s in live for pod in _pods_of(s)}


def state_pod_ids(state_dir: Path) -> set[str]:
    """Every pod id a launch state recorded – also those whose provision row was never
    written (the controller died between saving the id and the ledger row)."""
    return {pod for s in _lane_states(state_dir) for pod in _pods_of(s)}


def _terminate(provider: Provider, pod_id: str, attempts: int) -> None:
    for attempt in range(attempts):
        try:
            provider.terminate(pod_id)
            return
        except TransientError:
            if attempt == attempts - 1:
                raise
            time.sleep(2**attempt)


class ReapRefused(LaneError):
    """A pod id moetune did not record (or no id at all): never terminated."""


def check_own(provider: Provider, pod_id: str, own_ids: set[str]) -> None:
    """ReapRefused unless `pod_id` has the provider's id shape and moetune recorded it."""
    provider.check_id(pod_id)
    if pod_id not in own_ids:
        raise ReapRefused(
            f"refused: {provider.name} pod {pod_id!r} is not one moetune recorded "
            "(no provision row or launch state names it); nothing was touched",
            "`moetune pods list` marks moetune's pods; end anyone else's with their own tool",
        )


def reap(
    provider: Provider, ledger: Ledger, pod_id: str, own_ids: set[str], attempts: int = 3
) -> float:
    """Terminate one pod moetune recorded (`own_ids`), by id, retrying transient faults,
    and ledger what it cost – a failure too, before it is raised."""
    check_own(provider, pod_id, own_ids)
    try:
        spent = provider.status(pod_id).spent_usd
    except PodGone:
        spent = 0.0
    metrics = {"provider": provider.name, "pod_id": pod_id, "by": "reap"}
    try:
        _terminate(provider, pod_id, attempts)
    except TransientError as err:
        ledger.append(LedgerRow(kind="teardown", status="infra-failed", metrics=metrics,
                                cost_usd=round(spent, 4), reason=err.cause[:300]))  # fmt: skip
        raise
    row = LedgerRow(kind="teardown", status="ok", metrics=metrics, cost_usd=round(spent, 4))
    ledger.append(row)
    return spent
