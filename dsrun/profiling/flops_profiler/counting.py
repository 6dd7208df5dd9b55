"""How many operations each counted torch call performs, and the patching that observes the calls.

The forward pass is measured, not estimated: while a profile is active, the torch functions below are
replaced by wrappers that run the original and then add its count to the innermost module being run.
Counts follow DeepSpeed's flops profiler (flops = 2 x MACs for matrix products; a Linear's bias is not
counted; LayerNorm is 5 flops per element with an affine transform, 4 without; activations, softmax and
pooling 1 per element; embeddings and dropout 0). A call made from inside another counted call (for
example ``max_pool2d`` dispatching to ``max_pool2d_with_indices``) is not counted twice.

The ``@`` operator is counted too (DeepSpeed misses it); ``+`` and ``*`` as operators are not, as in
DeepSpeed, only ``torch.add``/``torch.mul`` and the tensor methods.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

Count = tuple[int, int]  # (flops, macs)


def _numel(x: object) -> int:
    """Elements of ``x`` when it is a tensor; 1 for any other argument."""
    return x.numel() if isinstance(x, torch.Tensor) else 1


def _linear(out, input, weight, bias=None) -> Count:
    macs = input.numel() * weight.shape[0]
    return 2 * macs, macs


def _conv(out, input, weight, bias=None, *args, **kwargs) -> Count:
    # every output element is a dot product over (C_in / groups) x kernel inputs
    macs = out.numel() * (weight.numel() // weight.shape[0])
    return 2 * macs + (out.numel() if bias is not None else 0), macs


def _conv_transpose(out, input, weight, bias=None, *args, **kwargs) -> Count:
    # every input element is scattered to (C_out / groups) x kernel outputs
    macs = input.numel() * (weight.numel() // weight.shape[0])
    return 2 * macs + (out.numel() if bias is not None else 0), macs


def _elementwise_1(out, input, *args, **kwargs) -> Count:
    return _numel(input), 0


def _broadcast(out, input, other, *args, **kwargs) -> Count:
    return _numel(out), 0


def _norm(per_element_affine: int, per_element_plain: int, weight_position: int) -> Callable[..., Count]:
    def count(out, input, *args, **kwargs) -> Count:
        weight = kwargs.get("weight", args[weight_position] if len(args) > weight_position else None)
        return input.numel() * (per_element_affine if weight is not None else per_element_plain), 0
    return count


def _batch_norm(out, input, running_mean=None, running_var=None, weight=None, bias=None, training=False,
                *args, **kwargs) -> Count:
    affine = weight is not None
    if training:  # statistics are computed as in layer_norm
        return input.numel() * (5 if affine else 4), 0
    return input.numel() * (2 if affine else 1), 0


def _matmul(out, input, other, *args, **kwargs) -> Count:
    # out has one element per (row, column) pair; each is a dot product of length input.shape[-1]
    macs = out.numel() * input.shape[-1]
    return 2 * macs, macs


def _addmm(out, input, mat1, mat2, *args, **kwargs) -> Count:
    macs = out.numel() * mat1.shape[-1]
    return 2 * macs + out.numel(), macs


def _einsum(out, equation, *operands, **kwargs) -> Count:
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    # zero-stride stand-ins: numpy only needs the shapes to price the contraction
    arrays = [np.broadcast_to(np.zeros(1, dtype=np.float32), tuple(t.shape)) for t in operands]
    report = np.einsum_path(equation, *arrays, optimize="optimal")[1]
    flops = next(int(float(line.split(":")[-1])) for line in report.splitlines() if "Optimized FLOP count" in line)
    return flops, flops // 2


def _sdpa(out, query, key, value, *args, **kwargs) -> Count:
    # scores Q K^T (L x S per query row, depth E) and the weighted sum with V (depth S, width Ev)
    key_len = key.shape[-2]
    macs = query.numel() * key_len + (query.numel() // query.shape[-1]) * key_len * value.shape[-1]
    return 2 * macs, macs


def _output_elements(out, *args, **kwargs) -> Count:
    return _numel(out), 0


# (owner, attribute name, counter). The owner's attribute is swapped while a profile is active.
COUNTED: list[tuple[Any, str, Callable[..., Count]]] = [
    (F, "linear", _linear),
    (F, "bilinear", lambda out, a, b, weight, bias=None: (2 * out.numel() * a.shape[-1] * b.shape[-1],
                                                          out.numel() * a.shape[-1] * b.shape[-1])),
    *[(F, name, _conv) for name in ("conv1d", "conv2d", "conv3d")],
    *[(F, name, _conv_transpose) for name in ("conv_transpose1d", "conv_transpose2d", "conv_transpose3d")],
    *[(F, name, _elementwise_1) for name in ("relu", "relu6", "elu", "leaky_relu", "gelu", "silu", "mish",
                                             "hardswish", "hardsigmoid", "softplus", "prelu", "glu",
                                             "softmax", "log_softmax", "softmin")],
    *[(F, name, _elementwise_1) for name in ("max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d",
                                             "avg_pool2d", "avg_pool3d", "adaptive_max_pool1d",
                                             "adaptive_max_pool2d", "adaptive_max_pool3d",
                                             "adaptive_avg_pool1d", "adaptive_avg_pool2d",
                                             "adaptive_avg_pool3d")],
    (F, "layer_norm", _norm(5, 4, weight_position=1)),  # layer_norm(input, normalized_shape, weight, ...)
    (F, "group_norm", _norm(5, 4, weight_position=1)),  # group_norm(input, num_groups, weight, ...)
    (F, "instance_norm", _norm(5, 4, weight_position=2)),  # instance_norm(input, rm, rv, weight, ...)
    (F, "rms_norm", _norm(4, 3, weight_position=1)),
    (F, "batch_norm", _batch_norm),
    (F, "scaled_dot_product_attention", _sdpa),
    (F, "interpolate", _output_elements),
    (torch, "matmul", _matmul), (torch, "mm", _matmul), (torch, "bmm", _matmul),
    (torch, "addmm", _addmm), (torch, "baddbmm", _addmm), (torch, "einsum", _einsum),
    (torch, "mul", _broadcast), (torch, "add", _broadcast),
    (torch.Tensor, "matmul", _matmul), (torch.Tensor, "mm", _matmul), (torch.Tensor, "bmm", _matmul),
    (torch.Tensor, "addmm", _addmm), (torch.Tensor, "__matmul__", _matmul),
    (torch.Tensor, "mul", _broadcast), (torch.Tensor, "add", _broadcast),
]


class _Active(threading.local):
    sink: Callable[[int, int], None] | None = None  # where counts go while a profile is active
    inside: bool = False  # within a counted call: nested counted calls are part of it


ACTIVE = _Active()


def _wrap(original: Callable, counter: Callable[..., Count]) -> Callable:
    @functools.wraps(original)
    def counted(*args: object, **kwargs: object) -> Any:  # the original's arguments, whatever they are
        sink = ACTIVE.sink
        if sink is None or ACTIVE.inside:
            return original(*args, **kwargs)
        ACTIVE.inside = True
        try:
            out = original(*args, **kwargs)
        finally:
            ACTIVE.inside = False
        try:
            flops, macs = counter(out, *args, **kwargs)
        except Exception:  # an unusual call form must not break the model; it is simply not counted
            return out
        sink(int(flops), int(macs))
        return out
    counted.__dsrun_original__ = original  # type: ignore[attr-defined]
    return counted


class Patches:
    """Installs the counting wrappers; :meth:`remove` puts every original back exactly as it was."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, bool, Any]] = []

    def install(self) -> None:
        if self._saved:
            return
        for owner, name, counter in COUNTED:
            if not hasattr(owner, name):  # e.g. F.rms_norm on an older torch
                continue
            own = name in vars(owner)
            original = getattr(owner, name)
            self._saved.append((owner, name, own, vars(owner).get(name)))
            setattr(owner, name, _wrap(original, counter))

    def remove(self) -> None:
        for owner, name, own, original in reversed(self._saved):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # it was inherited (e.g. Tensor.__matmul__ from TensorBase)
        self._saved.clear()

