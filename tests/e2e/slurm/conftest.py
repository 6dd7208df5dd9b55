"""The session's real Slurm cluster (tests/e2e/slurm/cluster.py): started once, on first use, by the worker that
runs the Slurm tests (they share one xdist group), stopped at the end of the session, jobs and daemons, by PID.
Tests that need it skip, naming the Debian packages, where slurm-wlm or munge is missing or not running as root."""
from __future__ import annotations

import os
from typing import Iterator

import pytest

from tests.e2e.slurm.cluster import SlurmCluster, missing_programs, start_cluster
from tests.helpers import require_programs


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    if missing_programs():
        require_programs(*missing_programs())  # skips, naming the packages
    if os.geteuid() != 0:
        pytest.skip("the Slurm cluster of the tests runs its daemons as root (SlurmUser=root): run as root")
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.stop()
