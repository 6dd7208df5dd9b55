"""Machines made of Linux network namespaces, for the tests that need more than one host on this machine: the
multi-host launcher tests (sshd on each, tests/integration/launcher/conftest.py) and the two-node Slurm cluster
(a ``slurmd`` on each, tests/e2e/slurm/test_two_nodes.py).

:func:`veth_pair` makes two namespaces joined by a veth pair, its ends named :data:`INTERFACE` on both sides (so
one ``GLOO_SOCKET_IFNAME`` fits every host), each end with its address in ``SUBNET.1`` / ``SUBNET.2``, and
deletes them (by name) when the block ends, also after a failure. Every namespace shares this machine's files,
processes and host name; :meth:`Host.machine` runs a command as a machine of its own besides: a host name of its
own (a UTS namespace) and an ``/etc/hosts`` that names every machine (bound over ``/etc/hosts`` in a mount
namespace of its own), so a node name resolves to that node's address, as on a real cluster. Needs root, ``ip``
(iproute2) and ``nsenter``/``unshare`` (util-linux).
"""
from __future__ import annotations

import contextlib
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

INTERFACE = "dsrun0"


def require_namespace_programs() -> None:
    """Skips the calling test without ``ip`` (iproute2, which tests/run installs) or ``nsenter``/``unshare``
    (util-linux, in Debian's essential set), naming the package."""
    import pytest

    from tests.helpers import require_programs

    require_programs("ip")
    missing = [name for name in ("nsenter", "unshare") if shutil.which(name) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}: apt-get install util-linux")


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=30)


@dataclass(frozen=True)
class Host:
    """One network namespace with its address on :data:`INTERFACE`."""

    namespace: str
    address: str
    netns_inode: str  # /proc/PID/ns/net of a process in it: which host a process runs on

    def enter(self, argv: list[str]) -> list[str]:
        """``argv`` in this host's network namespace (``ip netns exec``, which execs it: the PID is the command's)."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def machine(self, hostname: str, hosts_file: Path) -> list[str]:
        """The prefix that runs a command (appended to it) in this host's network namespace as a machine named
        ``hostname`` whose ``/etc/hosts`` is ``hosts_file``: each of ``nsenter``, ``unshare`` and the shell execs
        the next, so the PID of the started process is the command's."""
        script = 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"'
        return ["nsenter", f"--net=/run/netns/{self.namespace}", "--", "unshare", "--mount", "--uts", "--",
                "sh", "-c", script, str(hosts_file), hostname]


def _netns_inode(namespace: str) -> str:
    return _run("ip", "netns", "exec", namespace, "readlink", "/proc/self/ns/net").stdout.strip()


@contextlib.contextmanager
def veth_pair(subnet: str, label: str = "dsrun") -> Iterator[tuple[Host, Host]]:
    """Two hosts, ``SUBNET.1`` and ``SUBNET.2`` (``subnet`` is ``A.B.C``), joined by a veth pair; their namespaces
    are named ``LABEL-TAG-a``/``-b`` (TAG random) and deleted when the block ends."""
    tag = uuid.uuid4().hex[:6]
    names = (f"{label}-{tag}-a", f"{label}-{tag}-b")
    veths = (f"dsr{tag}a", f"dsr{tag}b")
    created: list[str] = []
    try:
        for namespace in names:
            _run("ip", "netns", "add", namespace)
            created.append(namespace)
        _run("ip", "link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        hosts = []
        for index, (namespace, veth) in enumerate(zip(names, veths)):
            address = f"{subnet}.{index + 1}"
            _run("ip", "link", "set", veth, "netns", namespace)
            _run("ip", "-n", namespace, "link", "set", veth, "name", INTERFACE)
            _run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", INTERFACE)
            _run("ip", "-n", namespace, "link", "set", INTERFACE, "up")
            _run("ip", "-n", namespace, "link", "set", "lo", "up")
            hosts.append(Host(namespace, address, _netns_inode(namespace)))
        yield hosts[0], hosts[1]
    finally:
        for namespace in created:  # the veth pair goes with them
            _run("ip", "netns", "del", namespace, check=False)
