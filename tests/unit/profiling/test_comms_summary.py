"""The comms logger's summary: DeepSpeed's table layout, trimmed means, bandwidths, verbose lines and the
straggler breakdown, checked on hand-fed calls (the 2-rank run is in tests/integration/test_monitors.py)."""
from __future__ import annotations

import re

import pytest

from dsrun.comm.logger import (CommsLogger, convert_size, format_summary, gbps, straggler_breakdown,
                               trim_mean)


def test_sizes_and_trimmed_mean_as_deepspeed_computes_them():
    assert convert_size(2048) == "2.0 KB"
    assert convert_size(678.86 * 2**20) == "678.86 MB"
    assert convert_size(0) == "0 B"
    # 10% trimmed from each end: of 10 values the smallest and the largest go
    assert trim_mean([100.0] + [1.0] * 8 + [0.0]) == 1.0
    assert trim_mean([3.0, 5.0]) == 4.0


def _logger() -> CommsLogger:
    logger = CommsLogger()
    logger.configure(enabled=True)
    for latency in (0.001, 0.002, 0.003):
        logger.record("all_reduce", 4096, 4096.0, latency)  # 2 ranks: traffic = 2*S*(N-1)/N = S
    logger.record("all_reduce", 1024, 1024.0, 0.001)
    logger.record("broadcast", 512, 512.0, 0.0005)
    return logger


def test_summary_data_counts_bytes_and_bandwidths_per_op_and_size():
    data = _logger().summary_data()
    assert list(data) == ["all_reduce", "broadcast"]
    assert data["all_reduce"]["count"] == 4 and data["all_reduce"]["message_bytes"] == 3 * 4096 + 1024
    rows = data["all_reduce"]["sizes"]
    assert [(r["message_bytes"], r["count"]) for r in rows] == [(1024, 1), (4096, 3)]
    big = rows[1]
    assert big["total_latency_ms"] == pytest.approx(6.0)
    assert big["avg_latency_ms"] == pytest.approx(2.0)
    expected_algbw = (gbps(4096, 0.001) + gbps(4096, 0.002) + gbps(4096, 0.003)) / 3
    assert big["algbw_gbps"] == pytest.approx(expected_algbw)
    assert big["busbw_gbps"] == pytest.approx(expected_algbw)  # busbw/algbw = 2(N-1)/N = 1 for N = 2


def test_summary_table_has_deepspeeds_twenty_character_columns():
    text = format_summary(_logger().summary_data())
    lines = text.splitlines()
    assert lines[0].startswith("Comm. Op            Message Size        Count               Total Latency(ms)   "
                               "Avg Latency(ms)     tput_avg (Gbps)     busbw_avg (Gbps)")
    assert lines[1] == "all_reduce"
    assert lines[2].startswith(" " * 20 + "1.0 KB".ljust(20) + "1".ljust(20) + "1.00".ljust(20))
    assert lines[3].startswith(" " * 20 + "4.0 KB".ljust(20) + "3".ljust(20) + "6.00".ljust(20) + "2.00")
    assert lines[4] == "broadcast"


def test_verbose_line_format(capsys):
    logger = CommsLogger(rank=1)
    logger.configure(enabled=True, verbose=True)
    logger.record("all_reduce", 6 * 2**20, 6 * 2**20, 0.01)
    out = capsys.readouterr().out.strip()
    assert re.fullmatch(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\] \[INFO\] \[dsrun\.comm\] \[Rank 1\] rank=1 \| "
                        r"comm op: all_reduce \| time \(ms\): 10\.00 \| msg size: 6\.0 MB \| algbw \(Gbps\): 5\.03"
                        r"  \| busbw \(Gbps\): 5\.03", out), out


def test_debug_names_the_caller_and_prof_ops_filters():
    logger = CommsLogger()
    logger.configure(enabled=True, prof_all=False, prof_ops=["broadcast"], debug=True)

    def _broadcast_model():
        logger.record("broadcast", 8, 8.0, 0.001)

    _broadcast_model()
    logger.record("all_reduce", 8, 8.0, 0.001)
    data = logger.summary_data()
    assert list(data) == ["broadcast"]
    assert "broadcast | [Caller Func: _broadcast_model]" in format_summary(data)


def test_straggler_is_own_latency_minus_the_fastest_rank_per_call():
    rank0 = {"all_reduce|64": [0.010, 0.020]}
    rank1 = {"all_reduce|64": [0.004, 0.025]}
    rows = straggler_breakdown(rank0, [rank0, rank1])["all_reduce"]
    assert rows[0]["count"] == 2
    assert rows[0]["total_straggler_ms"] == pytest.approx(6.0)  # (10-4) + (20-20)
    text = format_summary({}, straggler_breakdown(rank0, [rank0, rank1]))
    assert "Breakdown with straggler effect" in text and "Total straggler(ms)" in text
