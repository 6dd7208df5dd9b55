"""Stepping an elementwise optimizer over a huge flat parameter a chunk at a time, with the same bits.

ZeRO-3 steps one flat fp32 master per sub-group (tens of millions of elements). torch's Adam and AdamW
update each element from that element's own state alone, but their single-tensor step makes whole-size
temporaries (``exp_avg_sq.sqrt() / bias_correction``: two per step). On the CPU, where ZeRO-3 pins glibc's
mmap threshold (:mod:`dsrun.zero.host_memory`), each is a fresh mapping the kernel faults in and zeroes on
every step (a 50M-element master: 400 MB, ~100k page faults). :func:`chunked_step` hands the optimizer
views of ``chunk`` elements at a time instead, so its temporaries stay under the threshold and come back
from the heap. The arithmetic per element is unchanged, so the result is bit-identical.
"""
from __future__ import annotations

import torch

# optimizers whose step reads and writes each element of a parameter from that element's state alone
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)
# elements per chunk: 512 KiB fp32 temporaries, below the 1 MiB mmap threshold ZeRO-3 pins on the CPU;
# a multiple of every SIMD width, so each element takes the same vector or scalar path as in a whole step
STEP_CHUNK = 1 << 17


def can_chunk(optimizer: torch.optim.Optimizer, chunk: int = STEP_CHUNK) -> bool:
    """Whether :func:`chunked_step` would chunk: an elementwise optimizer whose big parameters all have state
    already (the first step makes it, so that one runs whole) and gradients of their own shape."""
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
        return False
    big = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None and p.numel() > chunk]
    return bool(big) and all(optimizer.state.get(p) and p.grad.shape == p.shape and p.is_contiguous()
                             and p.grad.is_contiguous() for p in big)


def _chunk_state(state: dict, numel: int, start: int, end: int) -> dict:
    """The state of elements ``[start, end)``: views of the per-element tensors, a copy of the rest (``step``)."""
    out = {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.numel() == numel and value.dim() > 0:
            out[key] = value.view(-1)[start:end]
        elif torch.is_tensor(value):
            out[key] = value.clone()
        else:
            out[key] = value
    return out


def chunked_step(optimizer: torch.optim.Optimizer, chunk: int = STEP_CHUNK) -> None:
    """``optimizer.step()``, over views of at most ``chunk`` elements of each big parameter (see the module
    docstring); a whole step where :func:`can_chunk` says no."""
    if not can_chunk(optimizer, chunk):
        optimizer.step()
        return
    groups = [g["params"] for g in optimizer.param_groups]
    added: list[torch.Tensor] = []
    whole: list[tuple[torch.Tensor, torch.nn.Parameter]] = []  # (a big parameter, its first chunk)
    try:
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                if p.grad is None or p.numel() <= chunk:
                    params.append(p)
                    continue
                flat, grad, state = p.detach().view(-1), p.grad.view(-1), optimizer.state[p]
                for start in range(0, p.numel(), chunk):
                    end = min(start + chunk, p.numel())
                    view = torch.nn.Parameter(flat[start:end], requires_grad=p.requires_grad)
                    view.grad = grad[start:end]
                    optimizer.state[view] = _chunk_state(state, p.numel(), start, end)
                    params.append(view)
                    added.append(view)
                    if start == 0:
                        whole.append((p, view))
            group["params"] = params
        optimizer.step()
        for p, first in whole:  # the counters every chunk advanced alike
            state, advanced = optimizer.state[p], optimizer.state[first]
            for key, value in state.items():
                if torch.is_tensor(value) and (value.numel() != p.numel() or value.dim() == 0):
                    value.copy_(advanced[key])
                elif not torch.is_tensor(value):
                    state[key] = advanced[key]
    finally:
        for group, params in zip(optimizer.param_groups, groups):
            group["params"] = params
        for view in added:
            optimizer.state.pop(view, None)
            view.grad = None
