"""Peak memory and bytes read per rank while a ZeRO-3 checkpoint with Adam is resharded, partial reads against
the full read (docs/checkpoint.md, "Resharding").

    PYTHONPATH=. python benchmarks/reshard_memory.py [--model gpt-small] [--dir D] [--json out.json]

Saves ``--model`` (default gpt-small, 124M parameters: masters and Adam's two moments 1.49 GB) after one
training step at ZeRO-3, fp32, on 1 rank and on 2 ranks (gloo, this machine's CPUs), converts the 1-rank
checkpoint to a universal folder, then loads each into a fresh engine on the other world size, once as dsrun
loads now (``partial``: each rank reads its own elements' byte ranges, dsrun/checkpoint/partial_state.py) and
once as it loaded before (``full``: every saved rank's optimizer file read whole and merged, then cut; the
benchmark swaps the partial sources for ``reshard.merge_rank_states`` / ``load_universal_state``, which is
what ``engine_io`` called before, reads the model states file whole, lets the strategy's ``state_dict()``
clone its masters for the cut and the CPU optimizer copy the loaded moments, as before). Cases: 2 -> 1 ranks, 1 -> 2 ranks, universal (saved on 1 rank) -> 2 ranks.

Per loading rank, measured around ``engine.load_checkpoint`` alone, in a fresh process whose engine is built
first: ``peak`` = VmHWM during the load (reset by ``clear_refs`` just before) minus VmRSS before it;
``share`` = the rank's own optimizer state (fp32 masters + 2 moments of its partition); ``rchar`` = bytes the
process read through read(2)-family calls (/proc/self/io, page cache hits included); ``counted`` = the bytes
the partial reader read (``tensor_file.READ_STATS``). The acceptance bound is peak <= 1.3 x (share + one buffer),
the buffer being ``tensor_file.CAST_BUFFER_BYTES`` (64 MiB; an fp32 load needs none).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ranks import rank_env, run_ranks  # noqa: E402

GiB = 1024 ** 3


def _io() -> dict[str, int]:
    with open("/proc/self/io", encoding="ascii") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def _rss() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _engine(model_name: str):
    import dsrun
    import torch
    from dsrun.models.registry import build_model

    torch.manual_seed(0)
    model = build_model(model_name, block_size=64)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _use_full_reads() -> None:
    """The load as it was before partial reads: every saved rank's file loaded whole and merged, the model states
    file read whole, the strategy's masters cloned for the cut, the optimizer copying the loaded moments."""
    from dsrun.checkpoint import deepspeed_format, engine_io, partial_state, reshard, universal_checkpoint
    from dsrun.checkpoint.safe_load import load_file

    def rank_files(paths, stage, shapes):
        return contextlib.nullcontext(reshard.merge_rank_states(
            [deepspeed_format.load_zero_state(p) for p in paths], stage, shapes))

    partial_state.PartialRankState = rank_files
    partial_state.PartialUniversalState = lambda tag_dir: contextlib.nullcontext(
        universal_checkpoint.load_universal_state(tag_dir))
    partial_state.model_states_without_parameters = lambda path, names: load_file(path)
    reshard.master_sizes_only = lambda template: template
    engine_io.adopting_loaded_state = contextlib.nullcontext


def _rank(rank: int, world: int, port: int, results, job: dict) -> None:
    rank_env(rank, world, port, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // world)))
    import torch
    from dsrun import comm
    from dsrun.checkpoint import tensor_file
    from dsrun.estimate.measure import peak_rss_bytes, reset_peak_rss

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    comm.init_distributed(dist_backend="gloo", verbose=False)
    engine = _engine(job["model"])
    if job["kind"] == "save":
        vocab = engine.module.config.vocab_size
        tokens = torch.randint(0, vocab, (1, 65), generator=torch.Generator().manual_seed(rank))
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(job["dir"], tag="saved")
        results.put((rank, {}))
        return
    if job["mode"] == "full":
        _use_full_reads()
    gc.collect()
    comm.barrier()
    before, io0 = _rss(), _io()
    reset_ok = reset_peak_rss()
    stats = tensor_file.reset_read_stats()
    engine.load_checkpoint(job["dir"], tag=job["tag"])
    peak, io1 = peak_rss_bytes(), _io()
    share = sum(t.numel() for t in engine.strategy.state_dict()["fp32_flat_groups"]) * 4 * 3
    results.put((rank, {"peak_bytes": peak - before, "share_bytes": share, "rchar": io1["rchar"] - io0["rchar"],
                        "read_bytes": io1["read_bytes"] - io0["read_bytes"], "counted": stats.bytes_read,
                        "hwm_reset": reset_ok}))


def launch(world: int, job: dict) -> list[dict]:
    try:
        out = dict(run_ranks(_rank, world, job))
    except (RuntimeError, TimeoutError) as error:
        raise SystemExit(f"a rank of {job} failed: {error}") from error
    return [out[r] for r in range(world)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--dir", type=Path, default=None, help="where the checkpoints go (default: a temp folder)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    from dsrun.checkpoint import ds_to_universal, tensor_file

    buffer = tensor_file.CAST_BUFFER_BYTES
    rows = []
    with tempfile.TemporaryDirectory(prefix="dsrun-reshard-", dir=args.dir) as tmp:
        root = Path(tmp)
        for world in (1, 2):
            print(f"[bench] saving {args.model} at ZeRO-3 on {world} rank(s)", flush=True)
            launch(world, {"kind": "save", "model": args.model, "dir": str(root / f"w{world}")})
        ds_to_universal.main(ds_to_universal.parse_arguments(
            ["--input_folder", str(root / "w1" / "saved"), "--output_folder", str(root / "w1" / "saved_universal")]))
        cases = [("2 -> 1", 1, "w2", "saved"), ("1 -> 2", 2, "w1", "saved"), ("universal -> 2", 2, "w1", "saved_universal")]
        for name, world, folder, tag in cases:
            for mode in ("full", "partial"):
                job = {"kind": "load", "model": args.model, "dir": str(root / folder), "tag": tag, "mode": mode}
                for rank, r in enumerate(launch(world, job)):
                    r.update(case=name, mode=mode, rank=rank, ratio=r["peak_bytes"] / (r["share_bytes"] + buffer))
                    rows.append(r)
                    print(f"{name:>15} {mode:>8} rank {rank}: peak {r['peak_bytes'] / GiB:6.2f} GiB | share "
                          f"{r['share_bytes'] / GiB:5.2f} GiB | peak/(share+buffer) {r['ratio']:4.2f} | rchar "
                          f"{r['rchar'] / GiB:5.2f} GiB | counted {r['counted'] / GiB:5.2f} GiB", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    worst = max(r["ratio"] for r in rows if r["mode"] == "partial")
    print(f"partial reads: worst peak/(share + {buffer >> 20} MiB buffer) = {worst:.2f} (bound 1.3)")
    return 0 if worst <= 1.3 else 1


if __name__ == "__main__":
    raise SystemExit(main())
