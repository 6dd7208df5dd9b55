"""How far the pipeline engine's training is from the same layers trained without pipelining: the figures
behind docs/pipeline.md's exactness claim (tests/integration/test_pipe.py asserts them against 1e-6).

The model and data are the integration tests' (tests/integration/_pipe_workloads.py): a language model with
its embedding tied to its output head (the two ends on different stages), ZeRO-1 in each stage, 4
micro-batches per step, AdamW, fp32, 50 steps. The reference runs the same layers one after the other in one
process on the same micro-batches. Printed: the largest relative difference of a per-step loss, and the
largest difference of a final weight relative to the largest weight.

    python benchmarks/pipeline_parity.py [--steps 50]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def pipeline_rank(rank: int, world: int, steps: int) -> dict:
    from tests.integration import _pipe_workloads as w

    return w.parity_case("lm", 2, 4, steps)


def worst(results: list[dict], ref: dict) -> tuple[float, float]:
    import torch

    loss = max(abs(a - b) / abs(b) for r in results for a, b in zip(r["losses"], ref["losses"]))
    params = {name: torch.as_tensor(v) for r in results for name, v in r["params"].items()}
    scale = max(float(p.abs().max()) for p in ref["params"].values())
    weight = max(float((params[n] - ref["params"][n]).abs().max()) for n in ref["params"]) / scale
    return loss, weight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    from tests.helpers import run_ranks
    from tests.integration import _pipe_workloads as w

    for world, label in ((2, "2 stages x 1 data-parallel (2 ranks)"), (4, "2 stages x 2 data-parallel (4 ranks)")):
        results = run_ranks(pipeline_rank, world, args.steps, timeout=900)
        loss, weight = worst(results, w.reference_run("lm", args.steps, 4, world // 2))
        print(f"{label}: {args.steps} steps, max relative loss difference {loss:.2e}, "
              f"max final-weight difference {weight:.2e} (relative to the largest weight)")


if __name__ == "__main__":
    main()
