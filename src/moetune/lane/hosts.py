"""The hosts of provider ssh's nodes: `lane.ssh.hosts` / `lane.ssh.host` parsed as
`[user@]host[:port]` (IPv6 bracketed: `[::1]:22`), each user a login name and each host a
DNS name or IP address – never text that ssh, scp or rsync could take for an option – and
the list checked against train.nnodes and node 0's address before anything is planned."""

from __future__ import annotations

import ipaddress
import re
from typing import TYPE_CHECKING

from moetune.lane.providers.base import LaneError, SshTarget

if TYPE_CHECKING:
    from moetune.config import RunConfig
    from moetune.config.lane import SshArgs

# `[user@]host[:port]`, the host a name, an IPv4 address or a bracketed IPv6 one ("[::1]:22");
# a bare IPv6 address (two colons or more) is taken whole, with the default port.
HOST_SPEC = re.compile(
    r"(?:(?P<user>[^@\s]+)@)?(?:\[(?P<v6>[^\]\s]+)\]|(?P<host>[^@:\s\[\]]+))(?::(?P<port>\d{1,5}))?"
)
# Names only: a leading "-" would reach ssh, scp or rsync as an option (-oProxyCommand=…).
USER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9._-]{0,63}")
# "_" too: ssh config aliases (SkyPilot names its clusters so) may hold one
HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}(?:\.[A-Za-z0-9_-]{1,63})*\.?")
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def node_targets(ssh: SshArgs) -> list[SshTarget]:
    """The hosts of the nodes, node 0 first: lane.ssh.hosts (`[user@]host[:port]`, the
    rest from lane.ssh), else lane.ssh.host alone."""
    if ssh.hosts:
        return [_target(spec, ssh, "lane.ssh.hosts entry") for spec in ssh.hosts]
    return [_target(ssh.host, ssh, "lane.ssh.host")] if ssh.host else []


def _target(spec: str, ssh: SshArgs, field: str) -> SshTarget:
    text = spec.strip()
    got = HOST_SPEC.fullmatch(text)
    if got is None and text.count(":") >= 2 and "@" not in text and "[" not in text:
        got = HOST_SPEC.fullmatch(f"[{text}]")  # a bare IPv6 address
    if got is None or not 0 < int(got["port"] or ssh.port) < 65536:
        raise LaneError(f"{field} {spec!r} is not [user@]host[:port]",
                        "fix it; an IPv6 address goes in brackets: [::1]:22")  # fmt: skip
    if got["v6"] and not _is_ip(got["v6"], 6):
        raise LaneError(f"{field} {spec!r}: brackets hold an IPv6 address, not {got['v6']!r}",
                        "write a name or IPv4 address without brackets")  # fmt: skip
    target = SshTarget(got["v6"] or got["host"], int(got["port"] or ssh.port),
                       got["user"] or ssh.user)  # fmt: skip
    check_target(target, f"{field} {spec!r}")
    return target


def check_target(target: SshTarget, where: str) -> None:
    """LaneError unless the user is a login name and the host a DNS name or IP address:
    nothing that ssh, scp or rsync could read as an option."""
    if not USER_NAME.fullmatch(target.user):
        raise LaneError(
            f"{where}: user {target.user!r} is not a login name",
            "use letters, digits, '.', '_' and '-', starting with a letter or '_'",
        )
    if not (HOST_NAME.fullmatch(target.host) or _is_ip(target.host)):
        raise LaneError(
            f"{where}: host {target.host!r} is not a host name or IP address",
            "name the host (letters, digits, '-', '.'), an IPv4 address or [IPv6]:port",
        )


def _is_ip(host: str, version: int | None = None) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return version is None or address.version == version


def is_loopback(host: str) -> bool:
    """True for this machine's own names (localhost, 127.0.0.0/8, ::1)."""
    if host.lower().rstrip(".") in LOOPBACK_NAMES:
        return True
    return _is_ip(host) and ipaddress.ip_address(host).is_loopback


def shown(target: SshTarget) -> str:
    """`user@host:port` as a person reads it (an IPv6 host bracketed)."""
    host = f"[{target.host}]" if ":" in target.host else target.host
    return f"{target.user}@{host}:{target.port}"


def check_node_hosts(cfg: RunConfig) -> None:
    """LaneError (one line) when the hosts cannot carry train.nnodes nodes as listed."""
    hosts, n = node_targets(cfg.lane.ssh), cfg.train.nnodes
    if not hosts:  # a dry run must not plan a launch that has nowhere to go
        raise LaneError(
            "provider ssh has no host: lane.ssh.host and lane.ssh.hosts are unset",
            "set lane.ssh.host (or --hosts / lane.ssh.hosts for several nodes)",
        )
    if n > 1 and len(hosts) < n:
        raise LaneError(
            f"train.nnodes={n} but provider ssh has {len(hosts)} host(s)",
            f"pass --hosts with {n} hosts, node 0 first (or set lane.ssh.hosts)",
        )
    if len(hosts) > n:  # the rest would be silently left out of the plan
        raise LaneError(
            f"lane.ssh.hosts lists {len(hosts)} hosts but train.nnodes={n}",
            f"pass --nnodes {len(hosts)}, or list only the {n} host(s) to use",
        )
    _check_distinct(hosts)
    _check_master(cfg, hosts)


def _check_distinct(hosts: list[SshTarget]) -> None:
    """A remote machine listed twice would run two nodes' ranks on one machine's GPUs; a
    loopback list is a deliberate one-machine rehearsal (each node its own directory)."""
    seen: dict[tuple[str, int], int] = {}
    for rank, t in enumerate(hosts):
        key = (t.host.lower().rstrip("."), t.port)
        if key in seen and not is_loopback(t.host):
            raise LaneError(
                f"lane.ssh.hosts names {t.host}:{t.port} twice (nodes {seen[key]} and {rank})",
                "list each machine once, one node per machine",
            )
        seen.setdefault(key, rank)


def _check_master(cfg: RunConfig, hosts: list[SshTarget]) -> None:
    """Node 0's address must be one every node reaches: a loopback one only when every
    node is this machine too."""
    master = cfg.train.master_addr or hosts[0].host
    if len(hosts) > 1 and is_loopback(master) and not all(is_loopback(t.host) for t in hosts):
        raise LaneError(
            f"node 0's address {master} is loopback, which the nodes on other hosts cannot reach",
            "pass --master-addr with node 0's address on the network (or name node 0 by it "
            "in --hosts)",
        )
