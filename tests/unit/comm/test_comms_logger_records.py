"""DeepSpeed's record API of the comms logger (``comms_dict``, ``get_raw_data``, ``get_operation_summary`` ...) over
dsrun's ``CommsLogger``: what ``record`` counts appears in DeepSpeed's layout, and a layout set by hand is kept as
given (its lists in step) and summarised without being reordered."""
from __future__ import annotations

import pytest

from dsrun.comm.logger import CommsLogger


def test_recorded_calls_in_deepspeeds_layout_and_summary() -> None:
    log = CommsLogger(enabled=True)
    for latency_s in (0.004, 0.001, 0.002):
        log.record("all_reduce", 1000, 2000.0, latency_s=latency_s)
    log.record("broadcast", 8, 8.0)  # untimed: counted, no latency
    assert log.has_data() and log.get_total_operations() == 4
    assert log.get_operation_names() == ["all_reduce", "broadcast"]
    count, latencies, algbws, busbws = log.get_raw_data()["all_reduce"][1000]
    assert count == 3 and latencies == pytest.approx([4.0, 1.0, 2.0])
    # bandwidths in Gbps: bytes * 8 / seconds / 1e9, the bus one over the traffic (2x the message here)
    assert algbws == pytest.approx([1000 * 8 / t / 1e9 for t in (0.004, 0.001, 0.002)])
    assert busbws == pytest.approx([2 * a for a in algbws])
    summary = log.get_operation_summary("all_reduce")[1000]
    assert summary["count"] == 3 and summary["total_latency_ms"] == pytest.approx(7.0)
    assert summary["avg_latency_ms"] == pytest.approx(7.0 / 3) and summary["msg_size_str"] == "1000 B"
    assert log.get_operation_summary("all_gather") is None
    log.reset_data()
    assert not log.has_data() and log.get_raw_data() == {}


def test_records_set_by_hand_stay_paired() -> None:
    log = CommsLogger()
    latencies = [3.0, 1.0, 2.0]
    algbws = [10.0 / t for t in latencies]
    log.comms_dict = {"all_reduce": {1024: [3, list(latencies), list(algbws), [2 * a for a in algbws]]}}
    assert log.get_operation_summary("all_reduce")[1024]["avg_latency_ms"] == 2.0
    stored = log.get_raw_data()["all_reduce"][1024]
    assert stored[1] == latencies and stored[2] == algbws  # not sorted by the summary
    assert log.snapshot()["all_reduce"]["count"] == 3 and log.snapshot()["all_reduce"]["message_bytes"] == 3 * 1024
