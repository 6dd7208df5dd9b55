"""The estimator's measured cases: GPT recipes at ZeRO stages 0-3 on 1, 2 and 4 CPU ranks, and AutoTP's
``+recipe=gpt_tp`` (TP=2 x ZeRO-1) on 2 ranks (``EXTRA_CASES``).

:func:`measure_cases` does what ``dsrun estimate-memory --measure`` does for each case, minus the
``dsrun train`` front end: it composes and validates the recipe and writes its run directory as
``dsrun train`` does (``write_run_files(resolve_run(compose_runspec(...)))``), then starts every rank as
dsrun's launcher starts it (``python -m dsrun.worker --run-dir RUN_DIR`` with ``RANK``/``WORLD_SIZE``/
``MASTER_*``, ``OMP_NUM_THREADS`` = cores / ranks, and glibc returning large blocks at once) and reads the
peak each rank records. Every rank is a fresh process, as in a real run; cases run side by side (at most
``MAX_PROCS`` rank processes at once) because a rank's start-up (imports) is single-threaded, and a
process's peak RSS is its own whatever runs next to it. :func:`predict` is ``dsrun estimate-memory``'s
prediction for the same overrides.

The model is widened so that model states are a real part of each rank's peak, and the batch kept small
so the steps are quick: GPT, 2 layers x 768 (14.4M parameters), micro batch 2 x 64 tokens, 2 steps. One step
would not do: the optimizer's states exist only from step 1's update on, and step 2's forward/backward raises
the peak (each rank's VmHWM after step 1 and after step 2, logged once: +25.5 MiB for gpt_zero0 and gpt_zero2 on
1 rank, +80 MiB for gpt_zero3 on 2, +0-2 MiB for ZeRO-1/2 on 2 and 4). A rank's CPU goes mostly to its imports
(torch ~1.3 s, dsrun ~0.9 s; not torch._dynamo, which only torch's own optimizers import: dsrun's CPU Adam leaves
it out, dsrun/utils/dynamo_free.py), not the steps: 4.5 s per rank in all (5.9 s with torch._dynamo).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from tests.helpers import CORES, REPO, free_port

RECIPES = ("gpt_zero0", "gpt_zero1", "gpt_zero2", "gpt_zero3")
RANKS = (1, 2, 4)
EXTRA_CASES = (("gpt_tp", 2),)  # (recipe, ranks) beyond RECIPES x RANKS: each rank holds half of every split matrix
SHAPE = ("model.n_layer=2", "model.n_embd=768", "model.block_size=64", "ds.train_micro_batch_size_per_gpu=2")
STEPS = ("train.max_steps=2", "train.eval_interval=0", "train.eval_iters=1", "train.save_interval=0")
MAX_PROCS = 4


def rank_threads(world_size: int) -> int:
    """What dsrun's launcher gives each CPU rank: cores / ranks (at least 1)."""
    return max(1, CORES // world_size)


@dataclass
class MeasuredCase:
    recipe: str
    world_size: int
    overrides: list[str]
    run_dir: str = ""
    records: list[dict] = field(default_factory=list)  # memory_peak_rank<r>.json, rank order


def _rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(rank_threads(world_size)),
               MALLOC_MMAP_THRESHOLD_="65536")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


def prepare(recipe: str, world_size: int, root: Path, extra: Sequence[str] = SHAPE) -> MeasuredCase:
    """Compose, validate and write the case's run directory, as ``dsrun train`` does."""
    from dsrun.compose import compose_runspec
    from dsrun.rundir import write_run_files
    from dsrun.runspec import resolve_run

    overrides = [f"+recipe={recipe}", f"launcher.num_procs={world_size}", *extra]
    run_dir = root / f"{recipe}-{world_size}"
    run_dir.mkdir(parents=True, exist_ok=True)
    write_run_files(run_dir, resolve_run(compose_runspec([*STEPS, *overrides])))  # the case may change STEPS
    return MeasuredCase(recipe, world_size, overrides, str(run_dir))


def measure_cases(cases: Sequence[MeasuredCase], timeout: float = 300) -> list[MeasuredCase]:
    """Run every case's ranks (fresh ``dsrun.worker`` processes), at most ``MAX_PROCS`` at once."""
    pending, running = list(cases), []
    deadline = time.monotonic() + timeout
    try:
        while pending or running:
            while pending and sum(len(p) for _, p in running) + pending[0].world_size <= max(MAX_PROCS,
                                                                                           pending[0].world_size):
                case = pending.pop(0)
                port = free_port()
                log = open(Path(case.run_dir) / "ranks.log", "w")
                procs = [subprocess.Popen([sys.executable, "-m", "dsrun.worker", "--run-dir", case.run_dir],
                                          env=_rank_env(r, case.world_size, port), cwd=REPO, stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                         for r in range(case.world_size)]
                log.close()
                running.append((case, procs))
            for case, procs in list(running):
                if all(p.poll() is not None for p in procs):
                    running.remove((case, procs))
                    if any(p.returncode != 0 for p in procs):
                        text = (Path(case.run_dir) / "ranks.log").read_text()[-4000:]
                        raise AssertionError(f"{case.recipe} on {case.world_size} ranks failed:\n{text}")
                    files = sorted(Path(case.run_dir).glob("memory_peak_rank*.json"))
                    case.records = [json.loads(f.read_text()) for f in files]
            if time.monotonic() > deadline:
                raise AssertionError(f"cases still running after {timeout:g}s: "
                                     f"{[(c.recipe, c.world_size) for c, _ in running]}")
            time.sleep(0.2)
    finally:
        for _, procs in running:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return list(cases)


def predict(case: MeasuredCase):
    """``dsrun estimate-memory``'s estimate (a Breakdown) for the case's overrides, with the rank runtime the
    estimator measures on this host at the ranks' thread count."""
    from dsrun.cli.estimate_memory import estimate_recipe

    return estimate_recipe(case.overrides, threads=rank_threads(case.world_size))


if __name__ == "__main__":  # python -m tests.integration._estimate_cases ROOT [RANKS] [RECIPES] [EXTRA]
    root = Path(sys.argv[1])
    ranks = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 and sys.argv[2] else RANKS
    recipes = sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] else RECIPES
    extra = sys.argv[4].split() if len(sys.argv) > 4 else SHAPE
    start = time.time()
    cases = measure_cases([prepare(r, n, root, extra) for n in ranks for r in recipes], timeout=3600)
    print(f"wall {time.time() - start:.1f}s, load {os.getloadavg()}", flush=True)
    with (root / "cases.jsonl").open("w") as f:
        for case in cases:
            f.write(json.dumps(case.__dict__) + "\n")
            print(case.recipe, case.world_size, [round(r["peak_bytes"] / 2**20, 1) for r in case.records])
