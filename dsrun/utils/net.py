"""This machine's network: a free TCP port."""
from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 10_000  # below this lie the well-known and registered services' ports


def ephemeral_range() -> tuple[int, int]:
    """The range the kernel picks the local port of an outgoing connection (or a bind to port 0) from."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A TCP port free on every interface of this machine right now, chosen below the kernel's ephemeral
    range where there is room: a port from that range can be handed to another process's outgoing connection
    (gloo opens many) between this check and the store's bind, one below it only to a process that asks for
    it by number. Whoever binds it next may still lose a race for it to such a process."""
    low, _ = ephemeral_range()
    if low - _LOWEST >= 1024:
        pick = random.SystemRandom()
        for _ in range(64):
            port = pick.randrange(_LOWEST, low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                try:
                    probe.bind(("", port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]
