"""Pruning masks: which weights, rows, heads or channels are kept.

Every mask keeps exactly ``keep_count(n, dense_ratio)`` of its ``n`` units (ties broken by position), so a
pruned weight has the density it was asked for. ``l1`` masks rank units by magnitude once; ``topk`` masks
rank learnable scores on every forward, with a straight-through gradient to the scores (movement pruning);
``snip_momentum`` ranks a running average of ``|w · dL/dw|``.

Block patterns (``sparse_pruning.shared_parameters.block_pattern``) act on a weight seen as a matrix
``[rows, columns]`` (a Conv2d's ``[out, in·kh·kw]``):

* ``NxM``: blocks of N rows by M columns are kept or pruned whole, ranked by the sum of their scores;
* ``N:M``: in every run of M consecutive weights along a row, the N with the highest scores are kept
  (density N/M).
"""
from __future__ import annotations

import re
import torch

from dsrun.utils.errors import Problem, UserError

from .quantizers import straight_through

_PATTERN = re.compile(r"^(\d+)(x|:)(\d+)$")


def keep_count(n: int, dense_ratio: float) -> int:
    """Units kept out of ``n`` at ``dense_ratio``: ``n · dense_ratio`` rounded half up."""
    return min(n, int(n * dense_ratio + 0.5))


def topk_mask(scores: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """A 0/1 mask (``scores``' shape and dtype) keeping the ``keep_count`` highest scores; among equal scores
    the earlier position wins, so every rank and every run picks the same units."""
    flat = scores.detach().reshape(-1)
    keep = keep_count(flat.numel(), dense_ratio)
    order = torch.argsort(flat, descending=True, stable=True)
    mask = torch.zeros(flat.numel(), dtype=scores.dtype, device=scores.device)
    mask[order[:keep]] = 1
    return mask.reshape(scores.shape)


def learned_mask(scores: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """:func:`topk_mask` of learnable ``scores`` whose gradient is the mask's gradient (straight through)."""
    return straight_through(topk_mask, scores, dense_ratio)


def parse_block_pattern(pattern: str | None, where: str) -> tuple[int, str, int] | None:
    if pattern is None:
        return None
    match = _PATTERN.match(pattern)
    if not match or int(match.group(1)) < 1 or int(match.group(3)) < 1:
        raise UserError(Problem(where, f"got {pattern!r}; allowed: 'NxM' or 'N:M' with N, M >= 1", "e.g. '4x1' or '2:4'"))
    n, kind, m = int(match.group(1)), match.group(2), int(match.group(3))
    if kind == ":" and n > m:
        raise UserError(Problem(where, f"got {pattern!r}; an N:M pattern keeps N of every M, so N <= M"))
    return n, kind, m


def check_pattern_fits(shape2d: tuple[int, int], pattern: tuple[int, str, int], where: str) -> None:
    rows, cols = shape2d
    n, kind, m = pattern
    if kind == "x" and (rows % n or cols % m):
        raise UserError(Problem(where, f"a [{rows}, {cols}] weight does not tile into {n}x{m} blocks",
                                "pick a block pattern dividing the weight's rows and columns"))
    if kind == ":" and cols % m:
        raise UserError(Problem(where, f"rows of {cols} weights do not split into runs of {m}",
                                "pick M dividing the weight's number of columns"))


def block_mask(scores2d: torch.Tensor, pattern: tuple[int, str, int], dense_ratio: float) -> torch.Tensor:
    """A 0/1 mask over a ``[rows, cols]`` score matrix following ``pattern`` (see the module docstring).
    For ``N:M``, ``dense_ratio`` above N/M keeps ``round(M · dense_ratio)`` per run (a schedule ramping
    down to the pattern)."""
    n, kind, m = pattern
    rows, cols = scores2d.shape
    scores2d = scores2d.detach().float()
    if kind == "x":
        blocks = scores2d.reshape(rows // n, n, cols // m, m).sum(dim=(1, 3))
        keep = topk_mask(blocks, dense_ratio)
        return keep.repeat_interleave(n, dim=0).repeat_interleave(m, dim=1)
    per_run = max(n, keep_count(m, dense_ratio))
    runs = scores2d.reshape(rows, cols // m, m)
    order = torch.argsort(runs, dim=2, descending=True, stable=True)
    keep = torch.zeros_like(runs)
    keep.scatter_(2, order[..., :per_run], 1.0)
    return keep.reshape(rows, cols)


def as_matrix(weight: torch.Tensor) -> torch.Tensor:
    """A weight as ``[rows, columns]``: Linear and Embedding as they are, Conv2d ``[out, in·kh·kw]``."""
    return weight.reshape(weight.shape[0], -1)


def row_scores(weight: torch.Tensor) -> torch.Tensor:
    """L1 norm of each output row (a Conv2d's output channel: its whole filter)."""
    return as_matrix(weight.detach().float()).abs().sum(dim=1)


def head_scores(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """L1 norm of each head's block of input columns of an attention output matrix ``[out, heads·hs]``."""
    w = weight.detach().float().abs()
    return w.reshape(w.shape[0], num_heads, -1).sum(dim=(0, 2))


def snip_density(step: int, offset: int, offset_end: int, stride: int, dense_ratio: float) -> float:
    """The density ``snip_momentum`` prunes to at ``step``: 1 before ``offset``; between ``offset`` and
    ``offset_end`` the cubic ramp ``d + (1 - d)(1 - p)^3`` (``p`` the fraction of the window done),
    re-evaluated only every ``stride`` steps; ``dense_ratio`` from ``offset_end`` on."""
    if step < offset:
        return 1.0
    if step >= offset_end or offset_end <= offset:
        return float(dense_ratio)
    at = offset + ((step - offset) // stride) * stride
    progress = (at - offset) / (offset_end - offset)
    return float(dense_ratio + (1.0 - dense_ratio) * (1.0 - progress) ** 3)
