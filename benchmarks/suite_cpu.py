"""Where the test suite's CPU goes: a pytest plugin recording, per test, its wall time, the CPU (user+sys) of the
pytest process running it and of its child processes (ranks, ``dsrun`` commands, agents), with the load average,
one JSON line per test; and a summary of such a log.

    DSRUN_SUITE_CPU_LOG=/tmp/cpu.jsonl python -m pytest -p benchmarks.suite_cpu tests/e2e   # appends to the log
    python benchmarks/suite_cpu.py /tmp/cpu.jsonl [N]   # totals, and the N tests (20) with the most CPU

The log defaults to ``dsrun_suite_cpu.jsonl`` in the temporary folder (not the repository, which the suite keeps
clean).

CPU seconds, unlike wall time, hardly change with what else runs on the machine, so two runs on a shared machine
compare. Children's CPU is the ``getrusage(RUSAGE_CHILDREN)`` delta (the children the test waited for, with theirs)
plus, for each child alive when the test ends (the forkserver that tests/helpers.py's ``run_ranks`` forks ranks
from), the growth of its own and its waited-for children's CPU (``/proc/PID/stat``). A process nobody waits for
(an orphan) is missed. With xdist each worker writes its own lines to the same file.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time

import pytest

LOG_ENV = "DSRUN_SUITE_CPU_LOG"


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _live_children_cpu() -> dict[int, float]:
    """pid -> CPU of each live child of this process, its own and its waited-for children's (/proc/PID/stat)."""
    tick, me, out = os.sysconf("SC_CLK_TCK"), os.getpid(), {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
            except OSError:
                continue
            if int(fields[1]) == me:  # utime, stime, cutime, cstime: fields 14-17 of stat, 12-15 here
                out[int(entry)] = sum(int(x) for x in fields[11:15]) / tick
    return out


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    wall, own, children = time.monotonic(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    live, load = _live_children_cpu(), os.getloadavg()[0]
    yield
    live_growth = sum(cpu - live.get(pid, 0.0) for pid, cpu in _live_children_cpu().items())
    record = {"test": item.nodeid, "wall_s": round(time.monotonic() - wall, 2),
              "cpu_s": round(_cpu(resource.RUSAGE_SELF) - own, 2),
              "children_cpu_s": round(_cpu(resource.RUSAGE_CHILDREN) - children + live_growth, 2),
              "load": round((load + os.getloadavg()[0]) / 2, 1)}
    path = os.environ.get(LOG_ENV) or os.path.join(tempfile.gettempdir(), "dsrun_suite_cpu.jsonl")
    with open(path, "a", encoding="utf-8") as log:
        log.write(json.dumps(record) + "\n")


def summarize(path: str, top: int = 20) -> str:
    records = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]

    def total(record: dict) -> float:
        return record["cpu_s"] + record["children_cpu_s"]

    own, children = sum(r["cpu_s"] for r in records), sum(r["children_cpu_s"] for r in records)
    lines = [f"{len(records)} tests: CPU {own + children:.1f} s (own {own:.1f}, children {children:.1f}), wall "
             f"{sum(r['wall_s'] for r in records):.1f} s summed over the workers",
             f"{'CPU s':>8} {'own':>7} {'children':>8} {'wall s':>7} {'load':>5}  test"]
    for r in sorted(records, key=total, reverse=True)[:top]:
        lines.append(f"{total(r):>8.1f} {r['cpu_s']:>7.1f} {r['children_cpu_s']:>8.1f} {r['wall_s']:>7.1f} "
                     f"{r['load']:>5.1f}  {r['test']}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20))
