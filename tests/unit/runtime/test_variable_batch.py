"""Dynamic batching (``data_sampling.dynamic_batching``, DeepSpeed's variable batch size and LR): the packing
against a transcription of DeepSpeed's exhaustive search, the LR scaling, the engine's loader on 2 ranks, the
Data Analyzer path, the config's refusals and the first-step warning when the loader is never built."""
from __future__ import annotations

import logging
import random

import pytest
import torch

import dsrun
from dsrun.data_efficiency.data_sampling.variable_batch_size_and_lr import (
    batch_by_seqlens, get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed,
    lr_scheduler_for_variable_batch_size, scale_lr)
from dsrun.utils.errors import ConfigError, UserError
from tests.helpers import run_ranks


def searched_packing(seqlens, max_tokens, ids, min_bs, max_bs, order, ebs, same_size, seed):
    """DeepSpeed's packing as its code states it: for every batch start, try every end (step k, below the list's
    length), keep the largest whose k round-robin micro-batches all satisfy the three limits."""
    items = [(seqlens[i], i) for i in (range(len(seqlens)) if ids is None else ids)]
    if order == "random":
        random.Random(seed).shuffle(items)
    elif order == "seqlen":
        items = sorted(items)
    items = [it for it in items if it[0] <= max_tokens]

    def fits(mb):
        return (not min_bs or len(mb) >= min_bs) and (not max_bs or len(mb) <= max_bs) \
            and sum(v for v, _ in mb) <= max_tokens

    k = ebs if same_size else 1
    mbs, start = [], 0
    while start < len(items):
        best = start
        for end in range(start + k, len(items), k):
            if all(fits(items[start:end][b::k]) for b in range(k)):
                best = end
        if best == start:
            break
        mbs += [items[start:best][b::k] for b in range(k)]
        start = best
    mbs = mbs[:len(mbs) - len(mbs) % ebs]
    ids_out, sizes, longest = [], [], []
    for b, first in enumerate(range(0, len(mbs), ebs)):
        group = mbs[first:first + ebs]
        sizes.append(sum(len(mb) for mb in group))
        longest.append(max(v for mb in group for v, _ in mb))
        ids_out += [(b, [i for _, i in mb]) for mb in group]
    return ids_out, sizes, longest


CASES = [  # max_tokens, filter ids, min, max, order, effective batch size, same size
    (40, None, 1, None, "dataloader", 4, False),
    (64, None, 2, 5, "random", 8, False),
    (64, None, 1, 3, "seqlen", 4, True),
    (25, "odd", 1, None, "random", 2, True),
    (100, None, 3, None, "dataloader", 2, True),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[4]}-ebs{c[5]}-{'same' if c[6] else 'any'}" for c in CASES])
def test_packing_equals_deepspeeds_exhaustive_search(case):
    max_tokens, filt, min_bs, max_bs, order, ebs, same = case
    rng = random.Random(7)
    seqlens = [rng.randrange(1, 30) for _ in range(300)] + [max_tokens + 5]  # one sample too long for any batch
    ids = list(range(1, len(seqlens), 2)) if filt == "odd" else None
    got = batch_by_seqlens(seqlens, max_tokens, ids, min_bs, max_bs, order, ebs, same, seed=42)
    assert got == searched_packing(seqlens, max_tokens, ids, min_bs, max_bs, order, ebs, same, 42)
    microbatch_ids, sizes, longest = got
    assert len(microbatch_ids) == ebs * len(sizes) and sizes
    for batch_id, mb in microbatch_ids:
        assert sum(seqlens[i] for i in mb) <= max_tokens and (not max_bs or len(mb) <= max_bs)
        assert len(mb) >= min_bs and max(seqlens[i] for i in mb) <= longest[batch_id]
    if same:  # a pipeline's micro-batches: one sample count per batch
        assert all(len({len(mb) for b, mb in microbatch_ids if b == batch}) == 1 for batch in range(len(sizes)))


def test_scale_lr_and_the_scheduler_over_a_constant_lr():
    assert scale_lr(8, 16, 0.1, "linear") == pytest.approx(0.2)
    assert scale_lr(8, 2, 0.1, "sqrt") == pytest.approx(0.05)
    assert scale_lr(8, 2, 0.1, "none") == 0.1 and scale_lr(8, 2, 0.1, None) == 0.1
    with pytest.raises(UserError, match="lr_scaling_method"):
        scale_lr(8, 2, 0.1, "cubic")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.4)
    sizes = [8, 4, 12]
    scheduler = lr_scheduler_for_variable_batch_size(8, sizes, None, optimizer, "linear")
    seen = [optimizer.param_groups[0]["lr"]]
    for _ in range(4):
        scheduler.step()
        seen.append(optimizer.param_groups[0]["lr"])
    assert seen == pytest.approx([0.4 * s / 8 for s in (8, 4, 12, 8, 4)])  # cycles through the batches
    state = scheduler.state_dict()
    scheduler.step(0)  # an epoch starts over at the first batch
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.4)
    scheduler.load_state_dict(state)
    assert scheduler.last_epoch == 4 and scheduler.batch_sizes == sizes


class Lengths(torch.utils.data.Dataset):
    """Sample i: a (length_i, 2) tensor of i's and its length; lengths 3..12."""

    def __init__(self, n: int = 96):
        self.lengths = [3 + (i * 7) % 10 for i in range(n)]

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return torch.full((self.lengths[i], 2), float(i)), self.lengths[i]


def collate(samples):
    return [int(x[0, 0]) for x, _ in samples], torch.tensor([n for _, n in samples], dtype=torch.float32)


def _config(**batching) -> dict:
    return {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "data_efficiency": {"enabled": True, "seed": 5, "data_sampling": {"dynamic_batching": {
                "enabled": True, "max_tokens": 20, "lr_scaling_method": "linear", **batching}}}}


def _rank_loader(rank: int, world: int):
    """A rank's view: the sample ids of its first step's micro-batches and the LR after one engine step."""
    model = torch.nn.Linear(1, 1)
    engine, *_ = dsrun.initialize(model=model, config=_config())
    dataset = Lengths()
    loader, scheduler, io_kwargs = get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        dataset, engine, dataset_seqlens=dataset.lengths, dataloader_collate_fn=collate)
    seen = []
    for ids, lengths in loader:
        seen.append(ids)
        loss = engine(lengths.reshape(-1, 1)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        if len(seen) == engine.gradient_accumulation_steps():
            break
    scheduler.step()
    return seen, scheduler.batch_sizes, optimizer_lr(engine), set(io_kwargs) == {
        "dataset", "batch_size", "pin_memory", "data_sampler", "collate_fn", "num_local_io_workers"}


def optimizer_lr(engine) -> float:
    return engine.optimizer.param_groups[0]["lr"]


def test_two_ranks_share_each_batch_and_the_lr_follows_its_size():
    results = run_ranks(_rank_loader, 2)
    dataset = Lengths()
    ids, sizes, _ = batch_by_seqlens(dataset.lengths, 20, effective_batch_size=8, seed=5)
    first_batch = [mb for b, mb in ids if b == 0]
    served = [sample for seen, *_ in results for loader_batch in seen for sample in loader_batch]
    assert sorted(served) == sorted(i for mb in first_batch for i in mb)  # the two ranks share batch 0 exactly
    for rank, (seen, batch_sizes, lr, kwargs_ok) in enumerate(results):
        # rank r takes micro-batches r, r+2, ...; a loader batch holds 2 of them (the micro-batch size)
        mine = first_batch[rank::2]
        assert seen == [mine[0] + mine[1], mine[2] + mine[3]]
        assert batch_sizes == sizes and kwargs_ok
        assert lr == pytest.approx(0.1 * sizes[1] / 8)  # stepped to the second batch's size


def test_seqlens_come_from_the_data_analyzer_and_the_first_step_warns_when_unused(world_of_one, tmp_path, capsys):
    dataset = Lengths(40)
    engine, *_ = dsrun.initialize(model=torch.nn.Linear(1, 1), config=_config(metrics_path=str(tmp_path)))
    lengths = lambda batch: torch.tensor(batch[1].tolist(), dtype=torch.int64)  # noqa: E731
    loader, _, _ = get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        dataset, engine, dataloader_collate_fn=collate, batch_seqlens_fn=lengths)
    assert (tmp_path / "seqlen" / "seqlen_sample_to_metric.idx").exists()
    ids, _, _ = batch_by_seqlens(dataset.lengths, 20, effective_batch_size=8, seed=5)
    assert [sample for batch, _ in loader for sample in batch] == [i for _, mb in ids for i in mb]

    unused, *_ = dsrun.initialize(model=torch.nn.Linear(1, 1), config=_config())
    for _ in range(2 * unused.gradient_accumulation_steps()):  # two optimizer steps: said at the first only
        unused.backward(unused(torch.ones(2, 1)).sum())
        unused.step()
    assert unused.global_steps == 2
    out = capsys.readouterr().out
    assert out.count("dynamic_batching is enabled but this run trains without its loader") == 1


def test_config_refusals(world_of_one):
    with pytest.raises(ConfigError, match="dynamic_batching.max_tokens: required"):
        dsrun.initialize(model=torch.nn.Linear(1, 1), config=_config(max_tokens=None))
    with pytest.raises(ConfigError, match="max_tokens_per_batch"):  # an early draft's name, not DeepSpeed's
        dsrun.initialize(model=torch.nn.Linear(1, 1), config=_config(max_tokens_per_batch=40))
    with pytest.raises(ConfigError, match="max_batch_size"):
        dsrun.initialize(model=torch.nn.Linear(1, 1), config=_config(min_batch_size=4, max_batch_size=2))


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_the_section_s_keys_reach_the_packing_and_the_scheduler(world_of_one):
    lines = Lines()
    logging.getLogger("DeepSpeed").addHandler(lines)
    dataset = Lengths(64)
    config = _config(sequence_picking_order="seqlen", min_batch_size=2, max_batch_size=3, lr_scaling_method="sqrt",
                     verbose=True)
    config["train_batch_size"] = 4  # world 1, micro 2: two micro-batches a step
    engine, *_ = dsrun.initialize(model=torch.nn.Linear(1, 1), config=config)
    loader, scheduler, _ = get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        dataset, engine, dataset_seqlens=dataset.lengths, dataloader_collate_fn=collate)
    ids, sizes, _ = batch_by_seqlens(dataset.lengths, 20, min_batch_size=2, max_batch_size=3,
                                     sequence_picking_order="seqlen", effective_batch_size=4)
    assert [sample for batch, _ in loader for sample in batch] == [i for _, mb in ids for i in mb]
    assert all(2 <= len(mb) <= 3 for _, mb in ids)
    assert scheduler.batch_sizes == sizes and len(set(sizes)) > 1
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * (sizes[0] / 4) ** 0.5)
    logging.getLogger("DeepSpeed").removeHandler(lines)
    assert any(line.startswith("Batch id 0 contains in total 4 microbatches") for line in lines.lines)  # verbose
