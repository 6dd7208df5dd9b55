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
clone its masters for the cut and the CPU optimizer copy the loaded moments, as before; every expert file and
every pipeline stage's optimizer files read whole and merged, as before). Cases: 2 -> 1 ranks, 1 -> 2 ranks,
universal (saved on 1 rank) -> 2 ranks,
and the paths that read whole files before issue 39's second round: a stage-0 save (its optimizer state is in
the model states file) on 1 rank -> ZeRO-3 on 2 ranks; the MoE GPT (``--model``'s sizes, 2 experts in every
second block) saved at ZeRO-1 with ep=1 on 1 rank -> ep=2 x ZeRO-1 on 2 ranks (the shared groups' optimizer file
and the experts' files); the pipelined GPT saved at 2 stages x ZeRO-1 on 2 ranks -> 1 stage x 2 data-parallel
ranks (every stage's optimizer files). ``--cases`` picks some (default: all).

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


def _engine(job: dict, world: int):
    """``job["arch"]``: ``gpt`` (at ZeRO ``job["stage"]``), ``moe`` (ep = the world size, ZeRO-1) or ``pipe``
    (``job["stages"]`` pipeline stages, ZeRO-1)."""
    import dsrun
    import torch
    from dsrun.models.registry import build_model, model_spec

    torch.manual_seed(0)
    arch, stage = job.get("arch", "gpt"), job.get("stage", 3)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if arch == "pipe":
        from dsrun.workloads.pipeline import build_pipeline_model

        stages = job["stages"]
        config.update(gradient_accumulation_steps=2, train_batch_size=2 * world // stages)
        model = build_pipeline_model({**model_spec(job["model"]), "block_size": 64, "pipeline_stages": stages},
                                     config, world)
        engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=config)
        return engine
    if arch == "moe":
        spec = {**model_spec(job["model"]), "_target_": "dsrun.models.moe_gpt.MoEGPT",
                "moe": {"num_experts": 2, "every": 2, "ep_size": world}}
        model = build_model(spec, block_size=64)
    else:
        model = build_model(job["model"], block_size=64)
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _train_step(engine, rank: int) -> None:
    import torch

    vocab = engine.module.config.vocab_size
    tokens = torch.randint(0, vocab, (1, 65), generator=torch.Generator().manual_seed(rank))
    if hasattr(engine, "train_batch"):  # a pipeline: its micro-batches from an iterator
        engine.train_batch(iter([(tokens[:, :-1], tokens[:, 1:])] * 2))
        return
    loss = engine(tokens[:, :-1], tokens[:, 1:])
    if isinstance(loss, tuple):  # the MoE GPT: (loss, auxiliary loss)
        loss = loss[0]
    engine.backward(loss)
    engine.step()


def _use_full_reads() -> None:
    """The load as it was before partial reads: every saved rank's file loaded whole and merged, the model states
    file read whole, the strategy's masters cloned for the cut, the optimizer copying the loaded moments."""
    import torch
    from dsrun.checkpoint import deepspeed_format, engine_io, experts, partial_state, pipeline_state, reshard
    from dsrun.checkpoint import universal_checkpoint
    from dsrun.checkpoint.safe_load import load_file
    from dsrun.pipe import checkpoint as pipe_checkpoint

    def rank_files(paths, stage, shapes):
        return contextlib.nullcontext(reshard.merge_rank_states(
            [deepspeed_format.load_zero_state(p) for p in paths], stage, shapes))

    partial_state.PartialRankState = rank_files
    partial_state.PartialUniversalState = lambda tag_dir: contextlib.nullcontext(
        universal_checkpoint.load_universal_state(tag_dir))
    partial_state.model_states_without_parameters = lambda path, names, module_unread=False: load_file(path)
    partial_state.PartialStagesState = lambda tag_dir, slices, bf16: contextlib.nullcontext(
        pipeline_state.merge_stages(tag_dir, slices, bf16))

    def expert_files(tag_dir, units, shared):  # every expert file loaded whole, as before
        full = reshard.FullOptimizerState(fp32=dict(shared.fp32), moments=dict(shared.moments),
                                          group_scalars=shared.group_scalars, param_groups=shared.param_groups,
                                          precision=shared.precision)
        full.close = lambda: None
        for unit in units:
            saved = load_file(tag_dir / unit.optim_file)
            for name, local in unit.local_names.items():
                full.fp32[local] = saved["fp32"][name].reshape(-1).float()
                full.moments[local] = {k: v.reshape(-1) for k, v in saved["optimizer_state"][name].items()
                                       if torch.is_tensor(v) and v.dim() > 0}
        return full

    experts._ExpertFiles = expert_files
    reshard.master_sizes_only = lambda template: template
    engine_io.adopting_loaded_state = contextlib.nullcontext
    pipe_checkpoint.adopting_loaded_state = contextlib.nullcontext


def _rank(rank: int, world: int, port: int, results, job: dict) -> None:
    rank_env(rank, world, port, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // world)))
    import torch
    from dsrun import comm
    from dsrun.checkpoint import tensor_file
    from dsrun.estimate.measure import peak_rss_bytes, reset_peak_rss

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    comm.init_distributed(dist_backend="gloo", verbose=False)
    engine = _engine(job, world)
    if job["kind"] == "save":
        _train_step(engine, rank)
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
    from dsrun.utils.zero_to_fp32 import optimizer_master_tensors

    share = sum(t.numel() for t in optimizer_master_tensors(engine.strategy.state_dict())) * 4 * 3
    results.put((rank, {"peak_bytes": peak - before, "share_bytes": share, "rchar": io1["rchar"] - io0["rchar"],
                        "read_bytes": io1["read_bytes"] - io0["read_bytes"], "counted": stats.bytes_read,
                        "hwm_reset": reset_ok}))


def launch(world: int, job: dict) -> list[dict]:
    try:
        out = dict(run_ranks(_rank, world, job))
    except (RuntimeError, TimeoutError) as error:
        raise SystemExit(f"a rank of {job} failed: {error}") from error
    return [out[r] for r in range(world)]


ZERO3 = {"save": {"stage": 3}, "load": {"stage": 3}}
# name: (loading ranks, checkpoint folder, tag, saving ranks, the engines' kind when saving and loading)
CASES = {"2 -> 1": (1, "w2", "saved", 2, ZERO3), "1 -> 2": (2, "w1", "saved", 1, ZERO3),
         "universal -> 2": (2, "w1", "saved_universal", 1, ZERO3),
         "stage 0 -> 2": (2, "s0", "saved", 1, {"save": {"stage": 0}, "load": {"stage": 3}}),
         "moe ep 1 -> 2": (2, "moe", "saved", 1, {"save": {"arch": "moe", "stage": 1},
                                                 "load": {"arch": "moe", "stage": 1}}),
         "pipe 2 stages -> 1 x dp 2": (2, "pipe", "saved", 2, {"save": {"arch": "pipe", "stage": 1, "stages": 2},
                                                              "load": {"arch": "pipe", "stage": 1, "stages": 1}})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--dir", type=Path, default=None, help="where the checkpoints go (default: a temp folder)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES), help="which loads")
    args = parser.parse_args(argv)
    from dsrun.checkpoint import ds_to_universal, tensor_file

    buffer = tensor_file.CAST_BUFFER_BYTES
    rows = []
    with tempfile.TemporaryDirectory(prefix="dsrun-reshard-", dir=args.dir) as tmp:
        root = Path(tmp)
        saved: set[str] = set()
        for name in args.cases:
            (world, folder, tag, save_world, arch) = CASES[name]
            if folder not in saved:
                print(f"[bench] saving {args.model} for '{name}' on {save_world} rank(s)", flush=True)
                launch(save_world, {"kind": "save", "model": args.model, "dir": str(root / folder), **arch["save"]})
                saved.add(folder)
            if tag == "saved_universal" and not (root / folder / tag).is_dir():
                ds_to_universal.main(ds_to_universal.parse_arguments(
                    ["--input_folder", str(root / folder / "saved"), "--output_folder", str(root / folder / tag)]))
            for mode in ("full", "partial"):
                job = {"kind": "load", "model": args.model, "dir": str(root / folder), "tag": tag, "mode": mode,
                       **arch["load"]}
                for rank, r in enumerate(launch(world, job)):
                    r.update(case=name, mode=mode, rank=rank, ratio=r["peak_bytes"] / (r["share_bytes"] + buffer),
                             zero3=arch["load"].get("stage", 3) == 3)
                    rows.append(r)
                    print(f"{name:>26} {mode:>8} rank {rank}: peak {r['peak_bytes'] / GiB:6.2f} GiB | share "
                          f"{r['share_bytes'] / GiB:5.2f} GiB | peak/(share+buffer) {r['ratio']:4.2f} | rchar "
                          f"{r['rchar'] / GiB:5.2f} GiB | counted {r['counted'] / GiB:5.2f} GiB", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    # the bound is for loads into ZeRO-3, whose module comes through the masters; at ZeRO-1 (the MoE and pipeline
    # cases) a rank also reads the whole module's weights, which it holds whole (docs/checkpoint.md)
    bounded = [r["ratio"] for r in rows if r["mode"] == "partial" and r["zero3"]]
    worst = max(bounded, default=0.0)
    print(f"partial reads into ZeRO-3: worst peak/(share + {buffer >> 20} MiB buffer) = {worst:.2f} (bound 1.3)")
    return 0 if worst <= 1.3 else 1


if __name__ == "__main__":
    raise SystemExit(main())
