"""Where an external fleet's rollout servers meet the learner for the NCCL weight group.

Rank 0 announces an address and a fixed port (`STAR_NCCL_MASTER_ADDR`, `STAR_NCCL_PORT`): the
servers, on other hosts or pods, join its TCP rendezvous there, each engine with all of its
tensor-parallel ranks (`weight_ranks`). Without a configured address, the one this host routes to
the first rollout server from is announced (what that server can reach back, NAT aside). The
announced address is kept in Redis (`{prefix}:weights:nccl_master`) for operators.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any
from urllib.parse import urlsplit


def nccl_master_key(prefix: str) -> str:
    return f"{prefix}:weights:nccl_master"


def route_address(url: str) -> str:
    """This host's address on the route to `url`'s host (a UDP socket's connect sends nothing)."""
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    if not host:
        raise ValueError(f"{url!r} names no host")
    family, _, _, _, addr = socket.getaddrinfo(host, port, proto=socket.IPPROTO_UDP)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr[:2])
        return s.getsockname()[0]


def announced_master(configured: str | None, port: int, servers: list[str]) -> tuple[str, int]:
    """(address, port) rank 0 announces: `configured` (host[:port]) when set, else the route address
    to the first server; a loopback address is refused when a server is on another host."""
    if configured:
        host, sep, given = configured.strip().rpartition(":")
        if sep and given.isdigit() and "]" not in given:
            return host.strip("[]"), int(given)
        return configured.strip().strip("[]"), port
    if not servers:
        raise ValueError("the learner announces an NCCL address to its rollout servers, and none are configured")
    address = route_address(servers[0])
    remote = any(not _loopback(urlsplit(u).hostname or "") for u in servers)
    if _loopback(address) and remote:
        raise ValueError(
            f"the route to {servers[0]} leaves through loopback ({address}); set STAR_NCCL_MASTER_ADDR "
            "to an address the rollout servers reach this learner at"
        )
    return address, port


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_master(spec: str, servers: list[str], settings: Any) -> tuple[str, int]:
    """RLConfig.nccl_master as (address, port): host:port as given, or `auto` (an external fleet):
    the announced address and port of `settings` (STAR_NCCL_MASTER_ADDR, STAR_NCCL_PORT)."""
    if spec.strip() == "auto":
        return announced_master(settings.nccl_master_addr, settings.nccl_port, servers)
    host, _, port = spec.rpartition(":")
    return host.strip("[]"), int(port)
