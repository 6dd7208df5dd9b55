"""DeepSpeed-Ulysses on CPU ranks: per-rank activation memory at twice the sequence, and the loss curve of
``+recipe=gpt_ulysses`` against one process on the same data, for docs/sequence_parallel.md.

    PYTHONPATH=$PWD python benchmarks/sequence_parallel.py --seq 512 --steps 20 --out benchmarks/sequence_parallel.json

Memory, exact counts (no timing): the built-in GPT (gpt-nano's shape, micro batch 4, fp32) runs one forward and
backward at sequence S and 2S in one process, and at 2S on 2 sequence-parallel ranks. ``saved``: the bytes
autograd keeps between forward and backward (``dsrun.profiling.tensor_memory.SavedTensorBytes``, parameters
left out): the activation memory. ``peak``: the most tensor bytes alive at once over forward and backward
(``TensorMemoryTracker``; includes the parameter gradients and the all-to-all buffers). One rank's activation
budget is defined as the single process's ``peak`` at S.

Training: ``dsrun train`` with gpt-nano at 2S for ``--steps`` steps, 2 ranks under ``+recipe=gpt_ulysses`` and
1 process with the same micro batch (so the same global batch and samples); the train losses, and tokens/s
as a ratio (medians of the step times are not separated from evaluation here; the load average is printed).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MICRO = 4


def _build(seq: int, sequence_parallel: bool) -> torch.nn.Module:
    from dsrun.models.gpt import GPT
    from dsrun.models.registry import model_spec

    spec = {k: v for k, v in model_spec("gpt-nano").items() if k != "_target_"}
    torch.manual_seed(0)
    return GPT(**{**spec, "block_size": seq, "sequence_parallel": sequence_parallel})


def _measure(rank: int, world: int, seq: int, port: int, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from dsrun.profiling.tensor_memory import SavedTensorBytes, TensorMemoryTracker

    if world > 1:
        from dsrun import comm
        from dsrun.comm import ProcessGroups
        from dsrun.comm.groups import set_current_groups

        comm.init_distributed(dist_backend="gloo", verbose=False)
        set_current_groups(ProcessGroups(sequence=world))  # what the engine does
    model = _build(seq, world > 1)
    tokens = torch.randint(0, 256, (MICRO, seq + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    if world > 1:  # each rank keeps its slice of the batch, as dsrun train feeds it
        from dsrun.sequence import shard_sequence

        inputs, targets = shard_sequence(inputs), shard_sequence(targets)
    with TensorMemoryTracker() as memory:
        with SavedTensorBytes(exclude=model.parameters()) as saved:
            loss = model(inputs, targets, sequence_sharded=True)
        loss.backward()
    results.put((rank, {"saved": saved.bytes, "peak": memory.peak}))
    if world > 1:
        comm.destroy_process_group()


def activation_bytes(seq: int, world: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = 29700 + seq % 97 + world
    procs = [ctx.Process(target=_measure, args=(r, world, seq, port, results)) for r in range(world)]
    for p in procs:
        p.start()
    out = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return [out[r] for r in range(world)]


def train(args: list[str], seq: int, steps: int) -> dict:
    run = Path(tempfile.mkdtemp(prefix="sp_bench_"))
    cmd = [sys.executable, "-m", "dsrun", "train", *args, f"model.block_size={seq}",
           f"ds.train_micro_batch_size_per_gpu={MICRO}", f"train.max_steps={steps}", "train.eval_iters=1",
           f"train.eval_interval={steps}", f"hydra.run.dir={run}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    m = json.loads((run / "metrics.json").read_text())
    return {"train_losses": m["train_losses"], "tokens_per_second": m["tokens_per_second"],
            "load_average_1m": os.getloadavg()[0]}


def _losses(run: dict) -> list[float]:
    return [row["loss"] if isinstance(row, dict) else float(row) for row in run["train_losses"]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=512, help="S: the single process's sequence")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    s = a.seq
    memory = {"single_S": activation_bytes(s, 1)[0], "single_2S": activation_bytes(2 * s, 1)[0],
              "sp2_2S": activation_bytes(2 * s, 2)}
    budget = memory["single_S"]["peak"]
    print(f"S={s}, micro batch {MICRO}, gpt-nano fp32; budget = one process's peak at S = {budget:,} bytes")
    print("| run | saved (activations) | peak | peak / budget |")
    for name, rows in (("1 process, S", [memory["single_S"]]), ("1 process, 2S", [memory["single_2S"]]),
                       ("2 ranks sp=2, 2S (per rank)", memory["sp2_2S"])):
        for row in [max(rows, key=lambda r: (r["peak"], r["saved"]))]:  # the larger rank
            print(f"| {name} | {row['saved']:,} | {row['peak']:,} | {row['peak'] / budget:.3f} |")
    result = {"seq": s, "micro_batch": MICRO, "budget": budget, "memory": memory, "steps": a.steps}
    if a.steps:
        result["single_2S"] = train(["launcher.num_procs=1"], 2 * s, a.steps)
        result["sp2_2S"] = train(["+recipe=gpt_ulysses"], 2 * s, a.steps)
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=1))
        one, two = result["single_2S"], result["sp2_2S"]
        first, second = _losses(one), _losses(two)
        diffs = [abs(x - y) for x, y in zip(first, second)]
        print(f"train losses at 2S, {len(diffs)} steps: first {first[0]:.4f} / {second[0]:.4f}, last "
              f"{first[-1]:.4f} / {second[-1]:.4f} (1 process / sp=2); max |diff| {max(diffs):.2e}")
        print(f"tokens/s sp=2 / 1 process: {two['tokens_per_second'] / one['tokens_per_second']:.2f} "
              f"(load average {one['load_average_1m']:.1f} / {two['load_average_1m']:.1f})")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
