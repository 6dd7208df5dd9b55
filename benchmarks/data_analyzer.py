"""DataAnalyzer throughput and its worker-count invariance on a million samples.

Indexes ``--samples`` windows of ``--seq`` byte tokens (a seeded Zipf-like stream) by vocabulary rarity, the
two map-reduce passes ``dsrun train`` runs for the ``vocabularyrarity`` metric (token frequencies, then each
window's rarity), with 1 worker, then with 2 and 4 workers (their maps run one after the other here, as they
would on separate hosts), and checks that every output file is byte-identical. Target (issue 23): 1e6 samples
indexed in <= 60 s on this machine with one worker.

    python benchmarks/data_analyzer.py [--samples 1000000] [--seq 64] [--workers 1,2,4]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _run_all(dataset, root: Path, workers: int) -> None:
    """analyse_vocabulary_rarity's two passes with ``workers`` map workers run one after the other."""
    import numpy as np

    from dsrun.data_efficiency.data_sampling.data_analyzer import ACCUMULATE, SINGLE_VALUE, DataAnalyzer
    from dsrun.data_efficiency.data_sampling.indexed_dataset import MMapIndexedDataset
    from dsrun.workloads.data_efficiency_run import (FREQUENCY, RARITY, token_frequency_metric,
                                                       vocabulary_rarity_metric)

    def passes(name, fn, kind):
        for worker in range(workers):
            DataAnalyzer(dataset, num_workers=workers, worker_id=worker, batch_size=4096, metric_names=[name],
                         metric_functions=[fn], metric_types=[kind], save_path=str(root)).run_map()
        DataAnalyzer(dataset, num_workers=workers, metric_names=[name], metric_functions=[fn], metric_types=[kind],
                     save_path=str(root)).run_reduce()

    passes(FREQUENCY, token_frequency_metric(256), ACCUMULATE)
    frequencies = np.array(MMapIndexedDataset(root / FREQUENCY / f"{FREQUENCY}_metric_value")[0])
    passes(RARITY, vocabulary_rarity_metric(frequencies), SINGLE_VALUE)


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--workers", default="1,2,4")
    args = parser.parse_args(argv)
    import torch

    from dsrun.data.dataset import TokenWindows

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rng = np.random.default_rng(0)
    tokens = np.minimum(rng.zipf(1.3, args.samples * args.seq + 1) - 1, 255).astype(np.uint8)
    dataset = TokenWindows(tokens, args.seq)
    scratch = Path(tempfile.mkdtemp(prefix="analyzer_bench_"))
    try:
        outputs = {}
        for workers in (int(w) for w in args.workers.split(",")):
            seconds = _timed(dataset, scratch / f"w{workers}", workers)
            outputs[workers] = digest(scratch / f"w{workers}")
            files = sum(1 for _ in (scratch / f"w{workers}").rglob("*") if _.is_file())
            print(f"{workers} worker(s): {len(dataset):,} samples x {args.seq} tokens indexed in {seconds:.1f}s "
                  f"({len(dataset) / seconds:,.0f} samples/s), {files} files", flush=True)
        first = next(iter(outputs.values()))
        same = all(o == first for o in outputs.values())
        print(f"outputs byte-identical across {sorted(outputs)} workers: {same}; load average "
              f"{os.getloadavg()[0]:.2f}, {os.cpu_count()} cores")
        return 0 if same else 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _timed(dataset, root: Path, workers: int) -> float:
    started = time.perf_counter()
    _run_all(dataset, root, workers)
    return time.perf_counter() - started


if __name__ == "__main__":
    sys.exit(main())
