"""The support ledger's proof for more keys whose effect shows only between ranks, on two gloo ranks (one launch
for all). Keys that change how gradients travel but not what training computes, each training to the same
weights as without it: ``sparse_gradients`` (at ZeRO stage 0 an embedding's gradient, ``nn.Embedding(sparse=True)``
here, is reduced as DeepSpeed's sparse all-reduce: only the rows the ranks' tokens touched),
``round_robin_gradients`` (stages 1-2 lay the flat groups out round-robin over the ranks) and
``use_multi_rank_bucket_allreduce: false`` (stages 1-2 reduce each rank's piece to it alone). And
``checkpoint.use_node_local_storage`` (two nodes of one rank each, each with its own folder: each node's storage
gets a whole checkpoint and resumes from it). ``zero_optimization.parameter_alignment`` (stages 1-2: gaps between
the parameters of the flat buffers) trains bit for bit as without it, and its checkpoint resumes, loads into the
packed layout at the same world size and, in the test process, at one rank. SGD throughout: the CPU Adam op would
cost seconds per rank to load."""
from __future__ import annotations

import functools
import tempfile
from typing import Any

from tests.helpers import run_ranks

VOCAB, WIDTH = 64, 8


def train_both_ways(rank: int, world: int, root: str) -> dict[str, Any]:
    return {"sparse": sparse_both_ways(rank), "round_robin": zero_keys_both_ways(rank, "round_robin_gradients"),
            "single_rank": zero_keys_both_ways(rank, "use_multi_rank_bucket_allreduce"),
            "serial_load": serial_load(rank, root),  # before node_local, which makes each rank a node of its own
            "alignment": alignment_both_ways(rank, root), "node_local": node_local_checkpoints(rank, root)}


def aligned_engine(stage: int, aligned: bool) -> Any:
    """Parameters of 15, 3, 21, 7, 14 and 2 elements (none a multiple of 4 but the last's gap), SGD with momentum
    and weight decay (per-element state), clipping (the norm), two micro-steps and 20-element buckets that cross
    the gaps and the partition boundary."""
    import torch

    import dsrun

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 7), torch.nn.Linear(7, 2))
    return dsrun.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.05, "zero_allow_untested_optimizer": True,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "parameter_alignment": aligned, "reduce_bucket_size": 20}})[0]


def aligned_steps(engine: Any, rank: int, first: int, steps: int, step: bool = True) -> list[float]:
    import torch
    import torch.nn.functional as F

    losses, last = [], 2 * (first + steps) - 1
    for micro in range(2 * first, last + 1):
        gen = torch.Generator().manual_seed(100 * micro + rank)
        loss = F.mse_loss(engine(torch.randn(2, 5, generator=gen)), torch.randn(2, 2, generator=gen))
        engine.backward(loss)
        if step or micro < last:  # step=False: the last (boundary) backward's gradients stay unapplied
            engine.step()
        losses.append(loss.item())
    return losses


def alignment_both_ways(rank: int, root: str) -> dict[str, Any]:
    """Per stage: the packed and the aligned run's losses and weights, the aligned layout (offsets, addresses,
    the gaps' values in the masters, the momentum and the step's gradients); then a checkpoint of the aligned run
    after 2 steps, resumed aligned and loaded packed, each trained 2 more steps."""
    import torch

    out: dict[str, Any] = {}
    for stage in (1, 2):
        runs = {}
        for aligned in (False, True):
            engine = aligned_engine(stage, aligned)
            runs[aligned] = {"losses": aligned_steps(engine, rank, 0, 4),
                             "weights": [p.detach().clone() for p in engine.module.parameters()]}
        group, strategy = engine.strategy.groups[0], engine.strategy
        aligned_steps(engine, rank, 4, 1, step=False)  # a boundary's backward: the step's gradients, unapplied
        lo, hi = group.partition_range(group.rank)
        own = [(max(a, lo) - lo, min(b, hi) - lo) for a, b in group.gaps if min(b, hi) > max(a, lo)]
        momentum = strategy.optimizer.state[strategy.masters[0]]["momentum_buffer"]
        runs["layout"] = {"offsets": group.offsets, "paddings": group.paddings, "numel": group.numel,
                          "padded_numel": group.padded_numel, "flat_ptr": group.flat_param.data_ptr(),
                          "ptrs": [p.data_ptr() for p in group.params], "element_size": group.flat_param.element_size(),
                          "own_gaps": own, "saved": strategy.state_dict()["param_alignment_paddings"],
                          "gap_values": [float(t[a:b].abs().sum()) for t in (strategy.masters[0].detach(), momentum,
                                                                             strategy.master_grads[0]) for a, b in own]}
        engine.zero_grad()
        out[f"{stage}"] = runs
        saved = f"{root}/aligned{stage}"
        engine = aligned_engine(stage, True)
        aligned_steps(engine, rank, 0, 2)
        engine.save_checkpoint(saved)
        out[f"{stage}-saved"] = {"path": saved, "weights": [p.detach().clone() for p in engine.module.parameters()]}
        expected = aligned_steps(engine, rank, 2, 2), [p.detach().clone() for p in engine.module.parameters()]
        for aligned in (True, False):
            fresh = aligned_engine(stage, aligned)
            fresh.load_checkpoint(saved)
            got = aligned_steps(fresh, rank, 2, 2), [p.detach().clone() for p in fresh.module.parameters()]
            out[f"{stage}-resumed-{aligned}"] = got[0] == expected[0] and all(
                torch.equal(a, b) for a, b in zip(got[1], expected[1]))
    return out


def serial_load(rank: int, root: str) -> dict[str, Any]:
    """ZeRO-3 saved on 2 ranks of one node, loaded with and without ``pipeline_loading_checkpoint``: when each
    rank's optimizer-state restore ran (wall clock, same host), the hand-over messages, the resumed weights."""
    import time

    import torch
    import torch.nn.functional as F

    import dsrun
    from dsrun import comm
    from dsrun.checkpoint import engine_io

    def build(serial: bool) -> Any:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        return dsrun.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
            "zero_optimization": {"stage": 3, "pipeline_loading_checkpoint": serial},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True})[0]

    def train(engine: Any, start: int) -> list[float]:
        losses = []
        for step in range(start, start + 2):
            gen = torch.Generator().manual_seed(10 * step + rank)
            loss = F.mse_loss(engine(torch.randn(2, 4, generator=gen)), torch.randn(2, 4, generator=gen))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        return losses

    engine = build(False)
    train(engine, 0)
    engine.save_checkpoint(f"{root}/serial")
    expected = train(engine, 2)
    restore, windows = engine_io._restore_strategy, []

    def timed(*args: Any, **kwargs: Any) -> None:
        start = time.time()
        time.sleep(0.2)  # a restore long enough that two running at once would overlap
        restore(*args, **kwargs)
        windows.append((start, time.time()))

    engine_io._restore_strategy = timed
    out: dict[str, Any] = {}
    try:
        for serial in (False, True):
            fresh = build(serial)
            comm.barrier()
            comm.reset_comms_stats()
            fresh.load_checkpoint(f"{root}/serial")
            stats = comm.get_comms_stats()
            out[serial] = {"window": windows[-1], "send": stats.get("send", {}).get("count", 0),
                           "recv": stats.get("recv", {}).get("count", 0), "resumed": train(fresh, 2) == expected}
    finally:
        engine_io._restore_strategy = restore
    return out


def node_local_checkpoints(rank: int, root: str) -> dict[str, Any]:
    import os
    from pathlib import Path

    import torch
    import torch.nn.functional as F

    import dsrun

    os.environ["LOCAL_RANK"] = "0"  # two nodes of one rank each; each node saves to its own folder

    def build(node_local: bool) -> Any:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        return dsrun.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "zero_optimization": {"stage": 1},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
            "checkpoint": {"use_node_local_storage": node_local}})[0]

    def train(engine: Any, start: int) -> list[torch.Tensor]:
        for step in range(start, start + 2):
            gen = torch.Generator().manual_seed(10 * step + rank)
            engine.backward(F.mse_loss(engine(torch.randn(2, 4, generator=gen)), torch.randn(2, 4, generator=gen)))
            engine.step()
        return [p.detach().clone() for p in engine.module.parameters()]

    out: dict[str, Any] = {}
    shared = build(False)
    train(shared, 0)
    try:  # without the key only rank 0 prepares a folder: rank 1's own folder gets none
        shared.save_checkpoint(f"{root}/plain{rank}")
        out["plain"] = "saved"
    except Exception as err:  # noqa: BLE001 - every rank learns of the failure
        out["plain"] = type(err).__name__
    engine = build(True)
    train(engine, 0)
    folder = Path(root) / f"node{rank}"
    engine.save_checkpoint(str(folder))
    expected = train(engine, 2)
    out["files"] = sorted(p.name for p in (folder / "global_step2").iterdir()) + [(folder / "latest").read_text()]
    fresh = build(True)
    fresh.load_checkpoint(str(folder))
    out["resumed"] = all(torch.equal(a, b) for a, b in zip(train(fresh, 2), expected))
    return out


def zero_keys_both_ways(rank: int, key: str) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import dsrun
    from dsrun import comm

    out: dict[str, Any] = {}
    for stage in (1, 2):
        for flag in (False, True):
            value = flag if key == "round_robin_gradients" else not flag  # flag: the key away from its default
            torch.manual_seed(0)
            model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3)))  # six parameters
            config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "gradient_accumulation_steps": 2,
                      "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
                      "zero_optimization": {"stage": stage, key: value, "reduce_bucket_size": 20}}
            engine = dsrun.initialize(model=model, config=config)[0]
            calls: list[str] = []
            originals = {name: getattr(comm, name) for name in ("reduce", "reduce_scatter")}
            for name, original in originals.items():
                setattr(comm, name, lambda *a, _name=name, _original=original, **k: calls.append(_name) or
                        _original(*a, **k))
            try:
                for step in range(4):
                    gen = torch.Generator().manual_seed(10 * step + rank)
                    engine.backward(F.mse_loss(engine(torch.randn(2, 4, generator=gen)),
                                               torch.randn(2, 4, generator=gen)))
                    engine.step()
            finally:
                for name, original in originals.items():
                    setattr(comm, name, original)
            out[f"{stage}-{flag}"] = {"weights": [p.detach().clone() for p in model.parameters()],
                                      "layout": list(engine.strategy.checkpoint_param_shapes()[0]),
                                      "calls": sorted(set(calls))}
    return out


@functools.lru_cache(maxsize=None)
def results() -> list[dict[str, Any]]:
    return run_ranks(train_both_ways, 2, tempfile.mkdtemp(prefix="dsrun-node-local-"), timeout=300)


def sparse_both_ways(rank: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import dsrun
    from dsrun import comm

    out: dict[str, Any] = {}
    for sparse in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, WIDTH, sparse=True), torch.nn.Linear(WIDTH, 1))
        config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "sparse_gradients": sparse,
                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 0}}
        engine = dsrun.initialize(model=model, config=config)[0]
        moved: dict[str, int] = {}
        originals = {name: getattr(comm, name) for name in ("all_reduce", "all_gather")}

        def counted(name: str) -> Any:
            def call(tensor: Any, *args: Any, **kwargs: Any) -> Any:
                sent = args[0] if name == "all_gather" else tensor  # all_gather(outputs, input)
                moved[name] = moved.get(name, 0) + sent.numel()
                return originals[name](tensor, *args, **kwargs)
            return call

        for name in originals:
            setattr(comm, name, counted(name))
        try:
            for step in range(3):
                gen = torch.Generator().manual_seed(10 * step + rank)
                tokens = torch.randint(0, 6, (2, 3), generator=gen)  # a few rows of the table, per rank
                loss = F.mse_loss(engine(tokens).squeeze(-1), torch.randn(2, 3, generator=gen))
                engine.backward(loss)
                engine.step()
        finally:
            for name, original in originals.items():
                setattr(comm, name, original)
        out[str(sparse)] = {"weights": [p.detach().clone() for p in model.parameters()], "moved": moved}
    return out


def test_sparse_gradients_reduce_embedding_rows_and_train_the_same() -> None:
    import torch

    ranks = [r["sparse"] for r in results()]
    for rank in ranks:
        dense, sparse = rank["False"], rank["True"]
        for a, b in zip(dense["weights"], sparse["weights"]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        table = VOCAB * WIDTH
        # dense: the whole table is all-reduced every step; sparse: only at most 6 touched rows travel
        assert dense["moved"]["all_reduce"] >= 3 * table and "all_gather" not in dense["moved"]
        assert sparse["moved"]["all_reduce"] == dense["moved"]["all_reduce"] - 3 * table
        assert 0 < sparse["moved"]["all_gather"] <= 3 * (2 + 6 + 6 * WIDTH)
    torch.testing.assert_close(ranks[0]["True"]["weights"], ranks[1]["True"]["weights"], rtol=0, atol=0)


def test_parameter_alignment_aligns_each_parameter_and_trains_the_same() -> None:
    import torch

    for stage in ("1", "2"):
        for rank, result in enumerate(r["alignment"][stage] for r in results()):
            packed, aligned, layout = result[False], result[True], result["layout"]
            # The gaps hold zeros nobody reads (checked exactly below). What moves with them is the order in which
            # the global norm's fp32 dot product adds the squares: a vector kernel's lanes shift with the offsets
            # (bitwise equal on an AVX2 CPU, not on an AVX-512 one). Any order of n additions is within
            # gamma_n = n u / (1 - n u) of the exact sum (u = 2^-24, n = 36 squares per partition), so the clip
            # coefficient moves by at most ~gamma_n = 2.1e-6 relative. Clipped to a norm of 0.05, each applied
            # gradient element is at most 0.05; through momentum 0.9 (at most 10x) and lr 0.1 a step's update
            # then moves by at most 0.05 * 2.1e-6 * 10 * 0.1 = 1.1e-7, 4 steps 4.2e-7, plus a last-bit rounding
            # of each weight (|w| < 2: 1.2e-7) per step. 2e-6 bounds both with room; a gap read as a value, or
            # a missed one, moves the coefficient by whole percents.
            torch.testing.assert_close(packed["losses"], aligned["losses"], rtol=2e-6, atol=0)
            for a, b in zip(packed["weights"], aligned["weights"]):
                assert float(a.abs().max()) < 2
                torch.testing.assert_close(a, b, rtol=0, atol=2e-6)
            # fp32: 4 elements = 16 bytes; every parameter starts on a 16-byte address (the buffer's own start
            # is at least that aligned), DeepSpeed's paddings: none after the last parameter
            assert layout["element_size"] == 4 and layout["flat_ptr"] % 16 == 0
            assert layout["offsets"] == [0, 16, 20, 44, 52, 68] and layout["paddings"] == [1, 1, 3, 1, 2, 0]
            assert [(ptr - layout["flat_ptr"]) // 4 for ptr in layout["ptrs"]] == layout["offsets"]
            assert all(ptr % 16 == 0 for ptr in layout["ptrs"])
            assert layout["saved"] == [layout["paddings"]]
            # the gaps count into the partitions: 70 elements padded to a multiple of 2 * 2 ranks
            assert layout["numel"] == 70 and layout["padded_numel"] == 72
            # this rank's partition [36 r, 36 (r + 1)) holds gaps whose master, momentum and gradient stay 0
            assert layout["own_gaps"] == ([(15, 16), (19, 20)] if rank == 0 else [(5, 8), (15, 16), (30, 32)])
            assert layout["gap_values"] == [0.0] * 3 * len(layout["own_gaps"])


def test_parameter_alignment_checkpoint_resumes_and_reshards_to_one_rank(monkeypatch) -> None:
    import torch

    from dsrun import comm
    from dsrun.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from tests.helpers import free_port

    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)  # a one-rank gloo group in this process for the loads at one rank
    comm.init_distributed(dist_backend="gloo", verbose=False)
    try:
        check_alignment_checkpoints(torch, get_fp32_state_dict_from_zero_checkpoint)
    finally:
        comm.destroy_process_group()


def check_alignment_checkpoints(torch: Any, to_fp32: Any) -> None:
    for stage in ("1", "2"):
        for result in results():
            assert result["alignment"][f"{stage}-resumed-True"]  # aligned -> aligned, 2 ranks: bit for bit
            assert result["alignment"][f"{stage}-resumed-False"]  # aligned -> packed, re-cut: bit for bit
        saved = results()[0]["alignment"][f"{stage}-saved"]
        names = ["0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias"]
        # zero_to_fp32 follows the saved gaps
        fp32 = to_fp32(saved["path"])
        assert all(torch.equal(fp32[n], w) for n, w in zip(names, saved["weights"]))
        # one rank, aligned and packed: the masters and momenta re-cut from the two saved partitions, so one more
        # step on the same batch gives the same weights in both layouts
        after = []
        for aligned in (True, False):
            engine = aligned_engine(int(stage), aligned)
            engine.load_checkpoint(saved["path"])
            assert all(torch.equal(p, w) for p, w in zip(engine.module.parameters(), saved["weights"]))
            aligned_steps(engine, 0, 2, 1)
            after.append([p.detach().clone() for p in engine.module.parameters()])
            engine.destroy()
        assert all(torch.equal(a, b) for a, b in zip(*after))


def test_round_robin_gradients_reorders_the_layout_and_trains_the_same() -> None:
    import torch

    for stage in (1, 2):
        plain, spread = (results()[0]["round_robin"][f"{stage}-{flag}"] for flag in (False, True))
        torch.testing.assert_close(plain["weights"], spread["weights"], rtol=0, atol=1e-6)
        names = ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]
        assert plain["layout"] == names
        assert spread["layout"] == names[0::2] + names[1::2]  # rank 0's turn, then rank 1's, as DeepSpeed's


def test_use_multi_rank_bucket_allreduce_false_reduces_each_piece_to_its_owner() -> None:
    import torch

    for stage in (1, 2):
        plain, single = (results()[0]["single_rank"][f"{stage}-{flag}"] for flag in (False, True))
        torch.testing.assert_close(plain["weights"], single["weights"], rtol=0, atol=1e-6)
        assert plain["calls"] == ["reduce_scatter"] and single["calls"] == ["reduce"]


def test_use_node_local_storage_gives_every_node_a_whole_checkpoint() -> None:
    for rank, result in enumerate(r["node_local"] for r in results()):
        assert result["plain"] != "saved"  # rank 0 alone keeps a folder without the key
        assert result["files"] == ["mp_rank_00_model_states.pt", f"rng_states_rank_{rank}.pt",
                                   f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", "global_step2"]
        assert result["resumed"]  # each node resumes from its own storage, bit for bit


def test_pipeline_loading_checkpoint_restores_one_local_rank_at_a_time() -> None:
    """zero_optimization.pipeline_loading_checkpoint: local rank 1 starts restoring its ZeRO-3 optimizer state
    only once rank 0 has finished (a one-element hand-over); without it the two restores run at once."""
    first, second = (r["serial_load"] for r in results())
    assert first[True]["window"][1] <= second[True]["window"][0]
    assert (first[True]["send"], first[True]["recv"], second[True]["send"], second[True]["recv"]) == (1, 0, 0, 1)
    assert max(first[False]["window"][0], second[False]["window"][0]) < min(first[False]["window"][1],
                                                                             second[False]["window"][1])
    assert all(r[k]["resumed"] for r in (first, second) for k in (False, True))
