"""dsrun's ZeRO-2 and ZeRO-3 against PyTorch's FSDP2 and DeepSpeed, and ZeRO-3 against stage 0 on one rank.

The peers a PyTorch user would pick instead of dsrun, on the same models, batch, optimizer (torch's AdamW, lr
1e-4, its defaults otherwise), precision (fp32) and 2 gloo ranks on the CPU:

* **FSDP2**, ``torch.distributed.fsdp.fully_shard`` on each transformer block and on the root. ZeRO-3 is
  compared with ``reshard_after_forward=True`` (parameters freed after the forward, gathered again for the
  backward: FSDP's FULL_SHARD) and ZeRO-2 with ``reshard_after_forward=False`` (parameters kept gathered from
  the forward to the backward: FSDP1's SHARD_GRAD_OP, the closest FSDP has to ZeRO-2, which keeps whole
  parameters on every rank and shards gradients and optimizer state). Before the first run a probe trains a
  tiny model under FSDP2 on gloo; if a collective it needs is missing there, FSDP1
  (``FullyShardedDataParallel`` with FULL_SHARD / SHARD_GRAD_OP) is measured instead and the output says so.
* **DeepSpeed** 0.19.8 when it is installed in a side environment, run by ``benchmarks/vs_deepspeed.py``'s
  machinery (its interpreter from ``--deepspeed-python`` or ``DSRUN_DEEPSPEED_PYTHON``; that script's
  docstring shows the install). Absent, its ratios are null.
* **A world of one**: dsrun's ZeRO-3 against dsrun's stage 0, both on one rank (``--world-of-one-model``),
  where ZeRO-3 keeps its parameters whole (dsrun/zero/whole_params.py) and should cost what stage 0 costs.

Models: ``gpt100m`` (12 layers of width 832, 8 heads, vocabulary 256, 16 positions: ~100M parameters, the
GPT of tests/integration/test_zero3_api.py's peak-RSS test) and ``lm4x384`` (4 layers of width 384, 6
heads, vocabulary 4096, 127 positions: vs_deepspeed.py's). Both tie the head to the embedding.

Every run is a fresh set of rank processes (vs_deepspeed.py's ``run_once``). For each model and stage the
frameworks alternate within each repeat (dsrun first on even repeats, last on odd ones), so slow drift of the
machine's load hits them alike; a ratio is the median over repeats of dsrun's median step time divided by the
peer's in the same repeat (wall time: the slowest rank's forward + backward + step; CPU time: the mean over
ranks of each rank's process time in the step). Peak RSS per rank is each rank's ``ru_maxrss`` over its run
(model build included). ::

    python benchmarks/vs_fsdp.py --json OUT [--models gpt100m lm4x384] [--repeats 3] [--steps 8] [--warmup 2]
        [--threads 1] [--details DETAILS.json] [--fsdp auto|fsdp2|fsdp1] [--no-deepspeed]

``OUT`` is ``{"<model>": {"zero2": {"vs_fsdp2": r, "vs_deepspeed": r}, "zero3": {...}}, "world_of_one":
{"zero3_vs_zero0": r}}`` (wall-time ratios, dsrun / peer; null where a peer is not installed or not run; with
the FSDP1 fallback the key is ``vs_fsdp1`` and ``vs_fsdp2`` is null). ``--details`` writes every run's figures.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_deepspeed  # noqa: E402  (benchmarks/ is the script's folder)
from engine_step import build_gpt  # noqa: E402

FSDP = "vs_fsdp:build_fsdp_step"  # the step builder vs_deepspeed's ranks import (vs_deepspeed.step_builder)
MODELS = {
    "gpt100m": {"layers": 12, "width": 832, "heads": 8, "vocab": 256, "seq": 17, "micro": 4},
    "lm4x384": {"layers": 4, "width": 384, "heads": 6, "vocab": 4096, "seq": 128, "micro": 4},
}
STAGES = {"zero2": 2, "zero3": 3}


# ------------------------------------------------------------------------------------------ FSDP's ranks
def build_fsdp_step(framework: str, stage: int, opts: dict):
    """The benchmark GPT under FSDP (``opts["fsdp"]``: ``fsdp2`` or ``fsdp1``), each block and the root sharded,
    resharding after the forward at ``stage`` 3 only; torch's AdamW. Returns a function that runs one training
    step on a batch of tokens and returns its loss."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = build_gpt(opts["vocab"], opts["seq"], opts["width"], opts["layers"], opts["heads"])
    reshard = stage == 3
    if opts["fsdp"] == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        strategy = ShardingStrategy.FULL_SHARD if reshard else ShardingStrategy.SHARD_GRAD_OP
        model = FullyShardedDataParallel(model, sharding_strategy=strategy, device_id=torch.device("cpu"),
                                         auto_wrap_policy=ModuleWrapPolicy({type(model.blocks[0])}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(tokens):
        loss = model(tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss
    return step


# ------------------------------------------------------------------------------------------ the driver
def probe_fsdp2(timeout: float) -> str | None:
    """None when FSDP2 trains a tiny model on 2 gloo ranks here, else why not (the last line of its error)."""
    tiny = {"layers": 1, "width": 32, "heads": 2, "vocab": 64, "seq": 8, "micro": 2, "steps": 1, "warmup": 1,
            "threads": 1, "world": 2, "fsdp": "fsdp2", "bf16": False, "native_adam": False}
    try:
        vs_deepspeed.run_once(sys.executable, FSDP, 3, tiny, timeout)
    except (RuntimeError, OSError) as err:
        lines = [line for line in str(err).splitlines() if line.strip()]
        return lines[-1] if lines else repr(err)
    return None


def deepspeed_python(given: str | None, skip: bool) -> tuple[str | None, str]:
    """DeepSpeed's interpreter (None when not installed or skipped) and what to print about it."""
    if skip:
        return None, "DeepSpeed: skipped (--no-deepspeed)"
    try:
        python = vs_deepspeed.find_deepspeed_python(given)
    except SystemExit as why:
        return None, f"DeepSpeed: not measured ({why})"
    return python, f"DeepSpeed: {python}"


def measure(python: str, framework: str, stage: int, opts: dict, timeout: float) -> dict:
    result = vs_deepspeed.run_once(python, framework, stage, opts, timeout)
    result["median"] = statistics.median(result["times"])
    result["cpu_median"] = statistics.median(result["cpu"])
    return result


def ratios(mine: list[dict], theirs: list[dict]) -> dict:
    """Medians over repeats of dsrun / peer (wall and CPU time), and each side's median figures."""
    return {"wall": statistics.median(a["median"] / b["median"] for a, b in zip(mine, theirs)),
            "cpu": statistics.median(a["cpu_median"] / b["cpu_median"] for a, b in zip(mine, theirs)),
            "pairs": [a["median"] / b["median"] for a, b in zip(mine, theirs)],
            "dsrun_ms": statistics.median(a["median"] for a in mine) * 1e3,
            "peer_ms": statistics.median(b["median"] for b in theirs) * 1e3,
            "dsrun_rss_mib": [max(r) / 2**20 for r in zip(*(a["peak_rss"] for a in mine))],
            "peer_rss_mib": [max(r) / 2**20 for r in zip(*(b["peak_rss"] for b in theirs))],
            "first_loss": [mine[0]["losses"][0], theirs[0]["losses"][0]]}


def _row(label: str, peer: str, r: dict) -> str:
    rss = "/".join(f"{x:.0f}" for x in r["dsrun_rss_mib"]) + " vs " + "/".join(f"{x:.0f}" for x in r["peer_rss_mib"])
    return (f"{label:<22}{peer:<11}{r['dsrun_ms']:>10.1f}{r['peer_ms']:>10.1f}{r['wall']:>8.2f}x{r['cpu']:>8.2f}x"
            f"   {rss:<24}{' '.join(f'{p:.2f}' for p in r['pairs'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True, help="the ratios (see the docstring)")
    parser.add_argument("--details", type=Path, default=None, help="every run's figures")
    parser.add_argument("--models", nargs="*", choices=sorted(MODELS), default=sorted(MODELS),
                        help="none: only the world of one")
    parser.add_argument("--world-of-one-model", choices=sorted(MODELS), default="lm4x384")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--fsdp", choices=("auto", "fsdp2", "fsdp1"), default="auto",
                        help="auto: FSDP2 unless its probe fails on gloo, then FSDP1")
    parser.add_argument("--deepspeed-python", default=None)
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)

    fsdp, why_not = args.fsdp, None
    if fsdp == "auto":
        why_not = probe_fsdp2(min(args.timeout, 300))
        fsdp = "fsdp1" if why_not else "fsdp2"
    fsdp_note = (f"FSDP: {fsdp}" + (f" (FSDP2 failed on gloo: {why_not}; FSDP1 measured instead)" if why_not else "")
                 + "; ZeRO-2 against reshard_after_forward=False (SHARD_GRAD_OP), ZeRO-3 against True (FULL_SHARD)")
    ds_python, ds_note = deepspeed_python(args.deepspeed_python, args.no_deepspeed)
    print(fsdp_note, ds_note, sep="\n", flush=True)
    base = {"steps": args.steps, "warmup": args.warmup, "threads": args.threads, "bf16": False, "native_adam": False,
            "fsdp": fsdp, "world": 2}
    peers = {fsdp: (sys.executable, FSDP)}
    if ds_python is not None:
        peers["deepspeed"] = (ds_python, "deepspeed")
    load_before, started = os.getloadavg(), time.time()

    out: dict = {}
    details: dict = {"fsdp": fsdp_note, "deepspeed": ds_note, "runs": {}}
    lines = []
    for model in args.models:
        opts = {**base, **MODELS[model]}
        out[model] = {}
        for key, stage in STAGES.items():
            runs: dict[str, list[dict]] = {"dsrun": [], **{p: [] for p in peers}}
            for r in range(args.repeats):
                order = ["dsrun", *peers] if r % 2 == 0 else [*reversed(list(peers)), "dsrun"]
                for name in order:
                    python, framework = (sys.executable, "dsrun") if name == "dsrun" else peers[name]
                    result = measure(python, framework, stage, opts, args.timeout)
                    runs[name].append(result)
                    print(f"{model} {key} repeat {r} {name:<9} median {result['median'] * 1e3:8.1f} ms  cpu "
                          f"{result['cpu_median'] * 1e3:8.1f} ms  peak RSS/rank "
                          f"{'/'.join(f'{x / 2**20:.0f}' for x in result['peak_rss'])} MiB  "
                          f"load {os.getloadavg()[0]:.1f}", flush=True)
            details["runs"][f"{model}/{key}"] = runs
            cell = {"vs_fsdp2": None, "vs_deepspeed": None}
            for peer in peers:
                r = ratios(runs["dsrun"], runs[peer])
                cell[f"vs_{peer}"] = r["wall"]
                details.setdefault("ratios", {})[f"{model}/{key}/{peer}"] = r
                lines.append(_row(f"{model} {key}", peer, r))
            out[model][key] = cell

    opts = {**base, **MODELS[args.world_of_one_model], "world": 1}
    alone: dict[str, list[dict]] = {"zero3": [], "zero0": []}
    for r in range(args.repeats):
        for key in (["zero3", "zero0"] if r % 2 == 0 else ["zero0", "zero3"]):
            result = measure(sys.executable, "dsrun", 3 if key == "zero3" else 0, opts, args.timeout)
            alone[key].append(result)
            print(f"world of one ({args.world_of_one_model}) {key} repeat {r} median {result['median'] * 1e3:8.1f} ms"
                  f"  cpu {result['cpu_median'] * 1e3:8.1f} ms  load {os.getloadavg()[0]:.1f}", flush=True)
    details["runs"]["world_of_one"] = alone
    r = ratios(alone["zero3"], alone["zero0"])
    details.setdefault("ratios", {})["world_of_one"] = r
    lines.append(_row(f"{args.world_of_one_model} zero3 1 rank", "zero0", r))
    out["world_of_one"] = {"zero3_vs_zero0": r["wall"]}

    load_after = os.getloadavg()
    print(f"\n2 gloo ranks x {args.threads} thread(s), fp32, torch AdamW; {args.steps} steps per run after {args.warmup}"
          f" warmup, {args.repeats} alternating repeats; {time.time() - started:.0f} s; load avg {load_before[0]:.1f}"
          f" before, {load_after[0]:.1f} after, on {os.cpu_count()} cores\n{fsdp_note}\n{ds_note}")
    print(f"{'model stage':<22}{'peer':<11}{'dsrun ms':>10}{'peer ms':>10}{'wall':>9}{'cpu':>9}   "
          f"{'peak RSS/rank MiB':<24}pair ratios")
    print("\n".join(lines))
    args.json.write_text(json.dumps(out, indent=2))
    if args.details:
        args.details.write_text(json.dumps({**details, "options": base, "load": [load_before, load_after]},
                                           indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
