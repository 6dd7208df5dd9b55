"""The session's real Slurm cluster (tests/e2e/slurm/cluster.py): started once, on first use, by the worker that
runs the Slurm tests (they share one xdist group, ``xdist_group("slurm")``, which collection checks), stopped at
the end of the session, jobs and daemons, by PID.
Tests that need it skip, naming the Debian packages, where slurm-wlm or munge is missing or not running as root."""
from __future__ import annotations

import os
from typing import Iterator

import pytest

from tests.e2e.slurm.cluster import SLURM_GROUP, SlurmCluster, missing_programs, start_cluster
from tests.helpers import require_programs


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that uses the cluster outside the one xdist group would start a second cluster on another worker
    (its jobs numbered as the first's): refused at collection, naming the marker to add."""
    strays = [item.nodeid for item in items if "slurm_cluster" in getattr(item, "fixturenames", ())
              and SLURM_GROUP not in {str(mark.args[0]) for mark in item.iter_markers("xdist_group") if mark.args}]
    if strays:
        raise pytest.UsageError(f"{', '.join(strays)}: uses slurm_cluster without "
                                f"pytest.mark.xdist_group({SLURM_GROUP!r}) (one cluster per test session)")


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
