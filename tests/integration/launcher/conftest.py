"""Fixtures for the launcher's integration tests.

``two_hosts`` builds two "machines" out of network namespaces (tests/namespaces.py): a veth pair joins
namespace A (10.213.77.1/24) and B (10.213.77.2/24), its ends named ``dsrun0`` on both sides (so one
``GLOO_SOCKET_IFNAME`` fits every host), and each runs its own sshd on its own address with a generated host
key and one authorized root key, all in a temporary directory. The launcher under test runs inside A and
reaches both hosts over ssh (A to itself, A to B). Everything is torn down at the end of the session,
also after failures: only the sshd PIDs started here are killed, then the namespaces are deleted.
Needs root, ``ip`` and OpenSSH (``tests/run`` installs them); without root or one of them the multi-host tests are
skipped, saying which.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import require_programs
from tests.namespaces import INTERFACE, Host, veth_pair

SUBNET = "10.213.77"


@dataclass
class TwoHosts:
    a: Host
    b: Host
    ssh_config: Path
    workdir: Path

    def job_dir(self, tmp_path: Path) -> Path:
        """A working directory for a job whose ``.dsrun_env`` tells gloo which interface joins the hosts
        (the hostname resolves to loopback in every namespace)."""
        folder = tmp_path / "job"
        folder.mkdir(exist_ok=True)
        (folder / ".dsrun_env").write_text(f"# exported to every node\nGLOO_SOCKET_IFNAME={INTERFACE}\n"
                                           f"TMPDIR={tmp_path}\n")  # agents' temporary logs stay in the test's folder
        return folder

    def hostfile(self, slots: int = 2) -> Path:
        path = self.workdir / f"hostfile{slots}"
        path.write_text(f"# two namespace hosts\n{self.a.address} slots={slots}\n\n{self.b.address} slots={slots}\n")
        return path

    def in_namespace(self, host: Host, argv: list[str]) -> list[str]:
        return host.enter(argv)


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=30)


def _write_sshd_config(folder: Path, address: str) -> Path:
    config = folder / f"sshd_config_{address}"
    config.write_text("\n".join([
        f"ListenAddress {address}", "Port 22", f"HostKey {folder}/host_key",
        f"AuthorizedKeysFile {folder}/authorized_keys", "PermitRootLogin prohibit-password",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
        "PidFile none", "UseDNS no", "PrintMotd no", "MaxStartups 100", "MaxSessions 100", "",
    ]))
    return config


def _wait_for_ssh(hosts: TwoHosts, host: Host, deadline: float) -> None:
    probe = hosts.in_namespace(hosts.a, ["ssh", "-F", str(hosts.ssh_config), host.address, "true"])
    last = ""
    while time.monotonic() < deadline:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30)
        if done.returncode == 0:
            return
        last = done.stderr.strip()
        time.sleep(0.3)
    raise RuntimeError(f"sshd on {host.address} did not come up: {last}")


@pytest.fixture(scope="session")
def two_hosts(tmp_path_factory: pytest.TempPathFactory):
    if os.geteuid() != 0:
        pytest.skip("multi-host tests need root for network namespaces (CI runs them as root)")
    sshd = require_programs("ip", "ssh", "ssh-keygen", "sshd")["sshd"]
    folder = tmp_path_factory.mktemp("two_hosts")
    sshd_processes: list[subprocess.Popen] = []
    with veth_pair(SUBNET) as (host_a, host_b):
        try:
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / "host_key"))
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / "id_ed25519"))
            shutil.copy(folder / "id_ed25519.pub", folder / "authorized_keys")
            ssh_config = folder / "ssh_config"
            ssh_config.write_text("\n".join([
                "Host *", f"  IdentityFile {folder}/id_ed25519", "  IdentitiesOnly yes", "  User root",
                "  StrictHostKeyChecking no", "  UserKnownHostsFile /dev/null", "  LogLevel ERROR",
                "  BatchMode yes", "",
            ]))
            os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
            hosts = TwoHosts(a=host_a, b=host_b, ssh_config=ssh_config, workdir=folder)
            for host in (hosts.a, hosts.b):
                config = _write_sshd_config(folder, host.address)
                _run(sshd, "-t", "-f", str(config))
                with open(folder / f"sshd_{host.address}.log", "w") as log:  # the child keeps its own copy
                    sshd_processes.append(subprocess.Popen(host.enter([sshd, "-D", "-e", "-f", str(config)]),
                                                           stdout=subprocess.DEVNULL, stderr=log))
            deadline = time.monotonic() + 30
            for host in (hosts.a, hosts.b):
                _wait_for_ssh(hosts, host, deadline)
            yield hosts
        finally:
            for process in sshd_processes:  # `ip netns exec` execs sshd, so this PID is sshd itself
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
            for process in sshd_processes:
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=10)
