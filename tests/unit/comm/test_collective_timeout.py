"""The bound on a collective a rank of its group never reaches: DeepSpeed's default (``DEEPSPEED_TIMEOUT`` minutes,
10 when unset, ``deepspeed.constants.default_pg_timeout``), and the backend's timeout reported as one line naming
the collective and its ranks. The 2-rank case, a rank stuck while its peer waits in the reduction, is
tests/integration/test_engine_faults.py::test_hung_rank_fails_within_bounded_time."""
from __future__ import annotations

from datetime import timedelta

import pytest

from dsrun.comm import comm


def test_the_default_timeout_is_deepspeeds_and_deepspeed_timeout_sets_it(monkeypatch) -> None:
    monkeypatch.delenv("DEEPSPEED_TIMEOUT", raising=False)
    assert comm.default_pg_timeout() == timedelta(minutes=10)
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "2.5")
    assert comm.default_pg_timeout() == timedelta(seconds=150)
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "ten")
    with pytest.raises(ValueError, match="DEEPSPEED_TIMEOUT='ten': expected minutes"):
        comm.default_pg_timeout()


def test_a_backend_timeout_names_the_collective_and_its_ranks_other_errors_pass_through() -> None:
    gloo = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation"
    with pytest.raises(comm.CollectiveTimeout) as info:
        with comm._named_timeout("all_gather_into_tensor", (0, 1)):
            raise RuntimeError(gloo + "\nmore lines")
    line = str(info.value)
    assert "\n" not in line and "all_gather_into_tensor over ranks [0, 1] timed out" in line
    assert "Timed out waiting 5000ms" in line and "never reached it" in line
    with pytest.raises(RuntimeError, match="^shapes differ$"):
        with comm._named_timeout("all_reduce", (0, 1)):
            raise RuntimeError("shapes differ")
