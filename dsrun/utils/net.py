"""This machine's network: a free TCP port."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on every interface of this machine right now (the OS picks one from its ephemeral
    range); whoever binds it next may still lose a race for it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]
