"""AutoEP's dispatch folded over AutoTP (DeepSpeed's ``deepspeed.moe.ep_tp_dispatch``: "route full, partition the
dispatch").

Folded, the ``tp_size`` ranks of a tensor-parallel group hold the same tokens and route them identically, so each
(token, expert) assignment exists on every one of them. Sending all of them through the expert-parallel all-to-all
would compute every assignment ``tp_size`` times. Instead each TP rank keeps the assignments whose ordinal inside
their expert's segment is ``tp_rank`` modulo ``tp_size`` (:func:`partition_assignments`: every expert's load is
spread over the lanes, each assignment sent exactly once), and after the experts ran, :func:`restore_combined`
all-gathers the lanes' outputs over the TP group and sums each token's top-k slots, weighted, in slot order (the
sum of the unpartitioned combine, bit for bit).

The all-gather's backward sums the ``tp_size`` identical copies of the output's gradient that the ranks hold and
keeps this rank's rows: the gradient of a parameter upstream of it (the router's scores) arrives ``tp_size`` times
its share, which the folded gradient reduction's ``average`` strategy divides out
(:func:`dsrun.autoep.folding.autoep_folding_gradient_reduction_strategy`).

:func:`assert_tp_payload_consistent` checks that the TP ranks did route alike before anything is partitioned: two
position-weighted digests of every field, compared by an all-reduce MAX and MIN over the group (RuntimeError when
they differ; with ``AUTOEP_FOLDING_DEBUG_PAYLOAD=1`` the message names the fields that differ).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.autograd.function import FunctionCtx

from dsrun import comm as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

Group = Optional["ProcessGroup"]  # the TP group; None: the world's (or no process group at tp_size 1)

# two primes below 2**31: a digest's products stay inside int64
_PRIME_A = 2_147_483_647
_PRIME_B = 2_147_483_629
_FIELDS = ("token_indices", "expert_indices", "assignment_indices", "capacity_slots", "combine_weights", "drop_mask",
           "pad_mask")


@dataclass
class RoutedAssignmentPayload:
    """The (token, expert) assignments of one MoE layer's batch, one row each, sorted by expert:
    ``token_indices`` (the token), ``expert_indices``, ``assignment_indices`` (its ordinal within its expert's rows),
    ``capacity_slots`` (its top-k slot), ``combine_weights`` (its router score), ``drop_mask`` / ``pad_mask`` (rows
    that carry nothing), the all-to-all's ``input_splits`` / ``output_splits`` and ``extra`` (``destination_ranks``:
    each row's expert-parallel rank; ``num_tokens``)."""

    token_indices: torch.Tensor
    expert_indices: torch.Tensor
    assignment_indices: torch.Tensor
    capacity_slots: torch.Tensor
    combine_weights: torch.Tensor
    drop_mask: torch.Tensor
    pad_mask: torch.Tensor
    input_splits: list[int]
    output_splits: list[int]
    extra: dict[str, Any]

    def active(self) -> torch.Tensor:
        """The rows that carry an assignment (neither dropped nor padding)."""
        return ~self.drop_mask & ~self.pad_mask


@dataclass
class RestoreContext:
    """What :func:`restore_combined` needs of a partition: the whole payload, the rows this rank kept, the group's
    size and this rank's place, the token count, and the partition's counters."""

    original_payload: RoutedAssignmentPayload
    local_indices: torch.Tensor
    tp_rank: int
    tp_size: int
    num_tokens: int
    counters: dict[str, int]


def assignment_ordinals_by_expert(expert_indices: torch.Tensor) -> torch.Tensor:
    """Each row's position inside its run of equal expert indices (0, 1, ... restarting at every new expert)."""
    count = expert_indices.numel()
    if count == 0:
        return expert_indices.to(torch.long)
    starts_run = torch.ones(count, dtype=torch.bool, device=expert_indices.device)
    starts_run[1:] = expert_indices[1:] != expert_indices[:-1]
    run_of_row = torch.cumsum(starts_run.to(torch.long), 0) - 1
    run_starts = torch.nonzero(starts_run, as_tuple=False).flatten()
    return torch.arange(count, device=expert_indices.device) - run_starts[run_of_row]


def _rows(payload: RoutedAssignmentPayload, rows: torch.Tensor) -> RoutedAssignmentPayload:
    """The payload restricted to ``rows`` (per-row ``extra`` tensors too; the splits copied as they are)."""
    length = payload.token_indices.shape[0]
    extra = {key: value.index_select(0, rows) if torch.is_tensor(value) and value.dim() and value.shape[0] == length
             else value for key, value in payload.extra.items()}
    picked = {name: getattr(payload, name).index_select(0, rows) for name in _FIELDS}
    return replace(payload, **picked, input_splits=list(payload.input_splits),
                   output_splits=list(payload.output_splits), extra=extra)


def _splits_by_destination(payload: RoutedAssignmentPayload) -> list[int]:
    """The rows bound for each expert-parallel rank (from ``destination_ranks``; without it the splits as given)."""
    destinations = payload.extra.get("destination_ranks")
    if destinations is None or not payload.input_splits:
        return list(payload.input_splits)
    counts = torch.bincount(destinations.to(torch.long), minlength=len(payload.input_splits))
    return [int(n) for n in counts[:len(payload.input_splits)].tolist()]


def _as_int(value: torch.Tensor | int | None) -> int:
    return int(value.item()) if torch.is_tensor(value) else int(value or 0)


def partition_assignments(payload: RoutedAssignmentPayload, *, tp_group: Group, tp_rank: int,
                          tp_size: int) -> tuple[RoutedAssignmentPayload, RestoreContext]:
    """This TP rank's share of the active assignments (those whose ordinal is ``tp_rank`` modulo ``tp_size``; all
    of them at ``tp_size`` 1) with the all-to-all splits recounted for it, and the context to restore from."""
    active = payload.active()
    keep = active if tp_size <= 1 else active & (payload.assignment_indices % tp_size == tp_rank)
    local_indices = torch.nonzero(keep, as_tuple=False).flatten()
    local = _rows(payload, local_indices)
    local.input_splits = _splits_by_destination(local)
    local.output_splits = list(local.input_splits)
    counters = {"assignments_total": int(active.sum()), "assignments_local": int(local_indices.numel()),
                "padded": int(payload.pad_mask.sum()), "dropped": int(payload.drop_mask.sum()),
                "split_sum_in": sum(local.input_splits), "split_sum_out": sum(local.output_splits)}
    ctx = RestoreContext(payload, local_indices, tp_rank, tp_size, _as_int(payload.extra.get("num_tokens", 0)),
                         counters)
    return local, ctx


def dispatch_counters(ctx: RestoreContext) -> dict[str, int]:
    """The partition's counts: active assignments, this rank's, padded and dropped rows, the split sums."""
    return dict(ctx.counters)


# --- the TP ranks routed alike? -------------------------------------------------------------------------------

def _words(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor as integers a digest can mix: floats scaled and rounded (so equal values give equal words)."""
    tensor = tensor.detach().reshape(-1)
    if tensor.is_floating_point():
        tensor = torch.nan_to_num(tensor.float(), nan=0.0, posinf=3.0e38, neginf=-3.0e38).mul(1_000_003.0).round()
    return tensor.to(torch.long)


def _mix(words: torch.Tensor, salt: int, prime: int) -> torch.Tensor:
    """A position-weighted sum of ``words`` modulo ``prime`` (positions salted, so a permutation changes it)."""
    weights = (torch.arange(words.numel(), dtype=torch.long, device=words.device) + 1 + salt) % prime
    return ((words % prime) * weights % prime).sum() % prime + words.numel() * salt % prime


def _field_tensors(payload: RoutedAssignmentPayload) -> dict[str, torch.Tensor]:
    fields = {name: getattr(payload, name) for name in _FIELDS}
    fields["active"] = payload.active()
    destinations = payload.extra.get("destination_ranks")
    fields["destination_ranks"] = destinations if torch.is_tensor(destinations) else torch.empty(0, dtype=torch.long)
    return fields


def _field_digest(index: int, tensor: torch.Tensor) -> torch.Tensor:
    words = _words(tensor)
    return torch.stack([torch.tensor(words.numel()), _mix(words, 17 * index, _PRIME_A),
                        _mix(words, 31 * index, _PRIME_B)])


def _payload_digest(payload: RoutedAssignmentPayload) -> torch.Tensor:
    """``[rows, input split sum, output split sum, digest mod A, digest mod B]`` of the whole payload."""
    digest = torch.tensor([payload.token_indices.numel(), sum(payload.input_splits), sum(payload.output_splits), 0, 0],
                          dtype=torch.long)
    for index, tensor in enumerate(_field_tensors(payload).values(), start=1):
        part = _field_digest(index, tensor.cpu())
        digest[3] = (digest[3] + part[1]) % _PRIME_A
        digest[4] = (digest[4] + part[2]) % _PRIME_B
    return digest


def _differing_fields(payload: RoutedAssignmentPayload, tp_group: Group) -> list[str]:
    """The fields whose digests differ over the group (collective: one MAX and one MIN all-reduce per field)."""
    differing = []
    for index, (name, tensor) in enumerate(_field_tensors(payload).items(), start=1):
        high = _field_digest(index, tensor.cpu())
        low = high.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=tp_group)
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=tp_group)
        if not torch.equal(high, low):
            differing.append(name)
    return differing


def assert_tp_payload_consistent(payload: RoutedAssignmentPayload, *, tp_group: Group, tp_size: int) -> None:
    """RuntimeError unless every rank of ``tp_group`` holds the same payload (collective; nothing to check at
    ``tp_size`` 1 or without a process group)."""
    if tp_size <= 1 or not dist.is_initialized():
        return
    digest = _payload_digest(payload)
    high, low = digest.clone(), digest.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=tp_group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=tp_group)
    if torch.equal(high, low):
        return
    detail = ""
    if os.environ.get("AUTOEP_FOLDING_DEBUG_PAYLOAD", "0").lower() in ("1", "true", "yes"):
        detail = f" Fields that differ: {_differing_fields(payload, tp_group)}; this rank's digest {digest.tolist()}."
    raise RuntimeError("AutoEP+AutoTP routing decisions differ across tensor-parallel lanes: folded dispatch needs "
                       "every TP rank to route the same tokens alike before the assignments are partitioned." + detail)


# --- restore: the lanes' outputs gathered and combined ----------------------------------------------------------

def _padded(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor.contiguous()
    return torch.cat([tensor, tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))])


def _gather_padded(tensor: torch.Tensor, group: Group, counts: tuple[int, ...]) -> torch.Tensor:
    """Every rank's rows (``counts[r]`` of them), concatenated in rank order."""
    width = max(counts)
    pieces = [tensor.new_empty((width, *tensor.shape[1:])) for _ in counts]
    dist.all_gather(pieces, _padded(tensor, width), group=group)
    return torch.cat([piece[:count] for piece, count in zip(pieces, counts)])


class _GatherRows(torch.autograd.Function):
    """The TP ranks' rows gathered (every rank gets them all). Backward: the gradient every rank holds of the whole
    summed over the group, this rank's rows kept (the ``tp_size`` factor the module docstring explains)."""

    @staticmethod
    def forward(ctx: FunctionCtx, tensor: torch.Tensor, group: Group, counts: tuple[int, ...]) -> torch.Tensor:
        ctx.group, ctx.counts, ctx.rank = group, counts, dist.get_rank(group=group)
        return _gather_padded(tensor, group, counts)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        width = max(ctx.counts)
        blocks = torch.stack([_padded(part, width) for part in torch.split(grad, list(ctx.counts))])
        dist.all_reduce(blocks, group=ctx.group)  # one collective for every rank's block
        return blocks[ctx.rank, :ctx.counts[ctx.rank]].contiguous(), None, None


def _gather_rows(tensor: torch.Tensor, group: Group, tp_size: int) -> torch.Tensor:
    """Every TP rank's rows of ``tensor`` (row counts may differ), differentiable when ``tensor`` needs a
    gradient; ``tensor`` itself at ``tp_size`` 1 or without a process group."""
    if tp_size <= 1 or not dist.is_initialized():
        return tensor
    counts = [torch.zeros(1, dtype=torch.long) for _ in range(tp_size)]
    dist.all_gather(counts, torch.tensor([tensor.shape[0]], dtype=torch.long), group=group)
    sizes = tuple(int(c) for c in counts)
    if max(sizes) == 0:
        return tensor.new_empty((0, *tensor.shape[1:]))
    if tensor.requires_grad:
        return _GatherRows.apply(tensor, group, sizes)
    return _gather_padded(tensor, group, sizes)


def _check_coverage(payload: RoutedAssignmentPayload, gathered: torch.Tensor) -> None:
    """RuntimeError unless the gathered (token, expert, ordinal, slot) rows are exactly the payload's active ones."""
    active = payload.active()
    expected = torch.stack([payload.token_indices[active], payload.expert_indices[active],
                            payload.assignment_indices[active], payload.capacity_slots[active]], 1).to(torch.long)
    if gathered.shape[0] != expected.shape[0]:
        raise RuntimeError(f"AutoEP+AutoTP restore coverage mismatch: {gathered.shape[0]} assignments gathered, "
                           f"{expected.shape[0]} routed")
    want = {tuple(row) for row in expected.tolist()}
    got = {tuple(row) for row in gathered.tolist()}
    if want != got:
        raise RuntimeError(f"AutoEP+AutoTP restore coverage mismatch: missing={sorted(want - got)[:5]} "
                           f"unexpected={sorted(got - want)[:5]}")


def restore_combined(local_combined: torch.Tensor, ctx: RestoreContext, *, tp_group: Group,
                     validate_coverage: bool = False) -> torch.Tensor:
    """``[num_tokens, hidden]``: each token's expert outputs (this rank's rows in ``local_combined``, the other TP
    ranks' gathered) weighted by their router scores and summed slot by slot in top-k order, the same on every TP
    rank. ``validate_coverage``: check that the gathered rows are every routed assignment, once."""
    payload = ctx.original_payload
    local = _rows(payload, ctx.local_indices)
    outputs = _gather_rows(local_combined, tp_group, ctx.tp_size)
    weights = _gather_rows(local.combine_weights.to(local_combined.dtype), tp_group, ctx.tp_size)
    tokens = _gather_rows(local.token_indices, tp_group, ctx.tp_size).to(torch.long)
    slots = _gather_rows(local.capacity_slots, tp_group, ctx.tp_size).to(torch.long)
    if validate_coverage:
        key = torch.stack([local.token_indices, local.expert_indices, local.assignment_indices,
                           local.capacity_slots], 1).to(torch.long)
        _check_coverage(payload, _gather_rows(key, tp_group, ctx.tp_size))
    if ctx.num_tokens <= 0:
        ctx.num_tokens = int(payload.token_indices.max()) + 1 if payload.token_indices.numel() else 0
    combined = local_combined.new_zeros((ctx.num_tokens, local_combined.shape[-1]))
    if outputs.numel():
        weighted = outputs * weights.reshape((-1,) + (1,) * (outputs.dim() - 1))
        for slot in torch.unique(slots).tolist():  # ascending: each token's slots added in top-k order
            rows = slots == slot
            combined = combined.index_add(0, tokens[rows], weighted[rows])
    return combined
