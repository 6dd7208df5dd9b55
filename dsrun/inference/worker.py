"""The rank entry of ``dsrun generate`` with several ranks: ``python -m dsrun.inference.worker --request R
--result OUT``. Every rank joins the generation (the model is split over all of them); rank 0 writes the
result as JSON for the command to print."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Sequence

import torch

from dsrun.launcher.protocol import exit_without_teardown


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsrun.inference.worker", description=__doc__)
    parser.add_argument("--request", type=Path, required=True, help="the request JSON dsrun generate wrote")
    parser.add_argument("--result", type=Path, required=True, help="where rank 0 writes the result JSON")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the launcher (also LOCAL_RANK)")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))

    from dsrun import comm
    from dsrun.rundir import atomic_write_text

    from .textgen import run_request

    comm.init_distributed(verbose=False)
    result = run_request(json.loads(args.request.read_text()))
    if comm.get_rank() == 0:
        atomic_write_text(args.result, json.dumps(result) + "\n")
    comm.barrier()
    comm.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
