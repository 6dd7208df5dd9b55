"""The built-in GPT under DeepSpeed-Ulysses (``model.sequence_parallel``, ``sequence_parallel_size``) on gloo
ranks, composed with ZeRO over the data x sequence ranks: the losses of a few SGD steps and the first step's
full gradients equal one float64 process training on the whole sequences, within a bound derived from the fp32
rounding of the sums involved; the engine's loader hands a sequence group the same samples."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import run_ranks

VOCAB, SEQ, LAYERS, HEADS, WIDTH = 32, 16, 2, 4, 16
MICRO, STEPS, LR = 2, 3, 0.1
IGNORED_POSITION = 3  # in the first sequence shard only: the shards hold unequal target counts


def tiny_gpt(positions: str, sequence_parallel: bool) -> torch.nn.Module:
    from dsrun.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH, positions=positions,
               sequence_parallel=sequence_parallel)


def batches(replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets ``[STEPS, replicas * MICRO, SEQ]``; one position of every sample ignored."""
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (STEPS, replicas * MICRO, SEQ + 1), generator=gen)
    inputs, targets = tokens[..., :-1], tokens[..., 1:].clone()
    targets[..., IGNORED_POSITION] = -100
    return inputs, targets


def train_sequence_parallel(rank: int, world: int, sp: int, positions: str, stage: int) -> dict:
    import dsrun
    from dsrun import comm
    from dsrun.profiling.tensor_memory import SavedTensorBytes
    from dsrun.utils import groups, safe_get_full_grad

    comm.init_distributed(dist_backend="gloo")
    try:
        model = tiny_gpt(positions, sequence_parallel=True)
        replicas = world // sp
        inputs, targets = batches(replicas)
        ids = torch.utils.data.TensorDataset(torch.arange(8 * replicas * MICRO))
        config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
                  "sequence_parallel_size": sp, "zero_optimization": {"stage": stage},
                  "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_allow_untested_optimizer": True}
        engine, _, loader, _ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                training_data=ids)
        rows = slice(rank // sp * MICRO, (rank // sp + 1) * MICRO)
        losses, grads = [], {}
        for step in range(STEPS):
            loss = engine(inputs[step, rows], targets[step, rows])
            engine.backward(loss)
            if step == 0:
                grads = {name: safe_get_full_grad(p).double().numpy() for name, p in model.named_parameters()}
            engine.step()
            losses.append(loss.item())
        saved = None
        if stage < 3:  # (ZeRO-3's gathered parameters would be counted as saved tensors)
            with SavedTensorBytes(exclude=model.parameters()) as counter:
                model(inputs[0, rows].clone(), targets[0, rows].clone())
            saved = counter.bytes
        train_batch = engine.train_batch_size()
        engine.set_train_batch_size(2 * MICRO * replicas)  # DeepSpeed's call counts replicas too
        return {"losses": losses, "grads": grads, "train_batch": train_batch, "saved": saved,
                "accumulation_after_resize": engine.gradient_accumulation_steps(),
                "first_ids": next(iter(loader))[0].tolist(), "sp": engine.sequence_parallel_size,
                "sp_rank": groups._get_sequence_parallel_rank(),
                "sp_world": groups._get_sequence_parallel_world_size(),
                "seq_dp_world": groups._get_sequence_data_parallel_world_size()}
    finally:
        comm.destroy_process_group()


def reference(replicas: int, positions: str) -> tuple[list[float], dict[str, np.ndarray]]:
    """One float64 process on the whole sequences of every replica's samples, plain SGD."""
    model = tiny_gpt(positions, sequence_parallel=False).double()
    inputs, targets = batches(replicas)
    losses, grads = [], {}
    for step in range(STEPS):
        model.zero_grad()
        loss = model(inputs[step], targets[step])
        loss.backward()
        if step == 0:
            grads = {name: p.grad.numpy().copy() for name, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
        losses.append(loss.item())
    return losses, grads


def single_saved(seq: int) -> int:
    """Activation bytes of one process's forward over the first ``seq`` tokens of the same micro-batch."""
    from dsrun.profiling.tensor_memory import SavedTensorBytes

    model = tiny_gpt("learned", sequence_parallel=False)
    inputs, targets = batches(1)
    with SavedTensorBytes(exclude=model.parameters()) as counter:
        model(inputs[0, :MICRO, :seq].clone(), targets[0, :MICRO, :seq].clone())
    return counter.bytes


@pytest.mark.parametrize("world,sp,positions,stage", [(2, 2, "learned", 2), (4, 2, "rotary", 3)],
                         ids=["sp2-zero2", "sp2xdp2-zero3"])
def test_sequence_parallel_gpt_matches_one_process(world, sp, positions, stage):
    replicas = world // sp
    ranks = run_ranks(train_sequence_parallel, world, sp, positions, stage, timeout=240)
    want_losses, want_grads = reference(replicas, positions)
    # fp32 against float64: each value is a chain of sums of lengths up to WIDTH and 4 WIDTH per layer
    # (matmuls), SEQ (attention), VOCAB (softmax) and the batch's tokens (the mean), a rounding of eps each
    summed = LAYERS * (4 * WIDTH + SEQ) + VOCAB + replicas * MICRO * SEQ
    bound = 8 * summed * torch.finfo(torch.float32).eps
    for rank, got in enumerate(ranks):
        assert got["train_batch"] == MICRO * replicas  # the batch counts world / sp data-parallel replicas
        assert got["accumulation_after_resize"] == 2
        assert (got["sp"], got["sp_world"], got["sp_rank"]) == (sp, sp, rank % sp)
        assert got["seq_dp_world"] == world  # ZeRO partitions and reduces over data x sequence ranks
        assert got["first_ids"] == ranks[rank - rank % sp]["first_ids"]  # a sequence group reads the same samples
        assert got["losses"] == ranks[rank - rank % sp]["losses"]  # every rank of a group reports its full loss
        for name, want in want_grads.items():
            assert np.abs(got["grads"][name] - want).max() <= bound * np.abs(want).max(), name
    # the replicas hold equal target counts, so the mean of their losses is the global batch's
    mean_loss = np.mean([ranks[r]["losses"] for r in range(0, world, sp)], axis=0)
    np.testing.assert_allclose(mean_loss, want_losses, rtol=bound, atol=0)
    firsts = [ranks[r]["first_ids"] for r in range(0, world, sp)]
    if ranks[0]["saved"] is not None:
        # activation bytes per rank at the whole sequence = half of one process's at that sequence (every
        # per-token tensor holds 1/sp of the tokens, every per-head one 1/sp of the heads), plus what the
        # exchange adds: each layer keeps the attention output apart from the output projection's input (one
        # [B, SEQ/sp, WIDTH] fp32 tensor), the rank holds the whole sequence's token ids (int64), and the loss
        # saves one scalar more
        whole = single_saved(SEQ)
        extra = LAYERS * MICRO * (SEQ // sp) * WIDTH * 4 + MICRO * (SEQ - SEQ // sp) * 8 + 8
        for got in ranks:
            assert whole // sp < got["saved"] <= whole // sp + extra, (got["saved"], whole)
    assert all(set(a).isdisjoint(b) for i, a in enumerate(firsts) for b in firsts[i + 1:])  # replicas differ
