"""A tiny user script for ``dsrun launch``: every rank all-reduces ``rank + 1`` and checks the sum.

    dsrun launch --num_procs 2 examples/launch_allreduce.py --out /tmp/allreduce

Each rank writes ``OUT/rank<R>.json`` with what the launcher gave it (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, CROSS_RANK, CROSS_SIZE, MASTER_ADDR, MASTER_PORT, the ``--local_rank`` argument,
OMP_NUM_THREADS, its PID and network namespace) and the all-reduce result. Options used by the launcher's
tests to exercise failure handling:

- ``--hang``: after the first all-reduce, write ``OUT/rank<R>.pid`` and keep all-reducing until killed;
- ``--idle``: like ``--hang`` but sleep instead of all-reducing, so a rank never notices that a peer died
  (only the launcher can stop it);
- ``--crash-once RANK``: that rank exits with code 3 the first time (a marker file in OUT remembers it),
  so a job with ``--max_restarts 1`` finishes on its second attempt.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for the per-rank reports")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the launcher")
    parser.add_argument("--hang", action="store_true")
    parser.add_argument("--idle", action="store_true")
    parser.add_argument("--crash-once", type=int, default=None, metavar="RANK")
    args = parser.parse_args()

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    out = args.out
    os.makedirs(out, exist_ok=True)
    if args.crash_once == rank:
        marker = os.path.join(out, f"crashed{rank}")
        if not os.path.exists(marker):
            open(marker, "w").close()
            print(f"rank {rank}: crashing on purpose", file=sys.stderr, flush=True)
            return 3

    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    expected = world_size * (world_size + 1) / 2
    report = {name: os.environ.get(name) for name in (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR",
        "MASTER_PORT", "OMP_NUM_THREADS", "LOCAL_SIZE")}
    report.update(local_rank_arg=args.local_rank, sum=value.item(), expected=expected, pid=os.getpid(),
                  netns=os.readlink("/proc/self/ns/net"), affinity=sorted(os.sched_getaffinity(0)),
                  attempt=os.environ.get("TORCHELASTIC_RESTART_COUNT"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
        json.dump(report, handle)
    # One write per line: under an unbuffered interpreter print() writes the text and the newline separately, and
    # mpirun, which merges every rank's stdout into one stream, can put another rank's line between the two.
    sys.stdout.write(f"rank {rank}/{world_size}: all-reduce sum {value.item()} (expected {expected})\n")
    sys.stdout.flush()
    if value.item() != expected:
        return 1
    if args.hang or args.idle:
        with open(os.path.join(out, f"rank{rank}.pid"), "w") as handle:
            handle.write(str(os.getpid()))
        while True:  # until the launcher stops us: busy in collectives (--hang) or asleep (--idle)
            if args.hang:
                dist.all_reduce(value)
            time.sleep(0.05)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
