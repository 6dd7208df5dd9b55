"""``TiledLinear``: a linear layer cut into ``in_splits x out_splits`` tiles, each its own ``linear_cls`` module.

Under ZeRO-3 each tile is gathered for its own forward and released after it, so a layer whose weight does
not fit on the device at once still runs: only one tile's weight is whole at a time (ZeRO-3's first stated
assumption: every submodule's forward must fit). Without ZeRO-3 it computes the same function as one linear
layer, in tiles.

The tile edges follow DeepSpeed's uniform partition: ``n`` features in ``k`` parts get ``n // k`` each, the
first ``n % k`` parts one more. Only the tiles of the last input split carry a bias, so the sum over input
splits adds it once.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import torch

from .gathered import GatheredParameters

# what one tile returns: its output, or (output, bias) for TiledLinearReturnBias's linear_cls
TileOutput = Union[torch.Tensor, tuple[torch.Tensor, Union[torch.Tensor, None]]]


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """The ``num_parts + 1`` boundaries of ``num_items`` split as evenly as possible (DeepSpeed's
    ``partition_uniform``): ``partition_uniform(10, 4) == [0, 3, 6, 8, 10]``."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    parts = [0]
    for p in range(num_parts):
        parts.append(parts[-1] + chunk + (1 if p < residual else 0))
    return parts


def split_tensor_along_last_dim(tensor: torch.Tensor, partitions: list[int],
                                contiguous_split_chunks: bool = False) -> tuple[torch.Tensor, ...]:
    """``tensor`` split along its last dimension into pieces of the given sizes."""
    pieces = torch.split(tensor, partitions, dim=tensor.dim() - 1)
    return tuple(p.contiguous() for p in pieces) if contiguous_split_chunks else pieces


class TiledLinear(torch.nn.Module):
    """A drop-in for ``torch.nn.Linear(in_features, out_features, bias)`` made of tiles.

    ``input_is_already_split``: ``forward`` takes a list of ``in_splits`` inputs; ``combine_out_splits=False``
    returns the ``out_splits`` outputs as a list. ``linear_cls(in, out, bias=..., **kwargs)`` builds each
    tile; ``init_linear`` (a linear layer of the full size) gives the initial weights.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1, out_splits: int = 1,
                 input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls: Callable[..., torch.nn.Module] = torch.nn.Linear,
                 init_linear: torch.nn.Module | None = None, **kwargs: Any):
        super().__init__()
        if in_splits < 1 or in_splits > in_features:
            raise RuntimeError("in splits must be in range [1, in_features].")
        if out_splits < 1 or out_splits > out_features:
            raise RuntimeError("out splits must be in range [1, out_features].")
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_parts = partition_uniform(in_features, in_splits)
        self.out_parts = partition_uniform(out_features, out_splits)
        self.linears = torch.nn.ModuleList()
        for out_id in range(out_splits):
            row = torch.nn.ModuleList()
            out_dim = self.out_parts[out_id + 1] - self.out_parts[out_id]
            for in_id in range(in_splits):
                in_dim = self.in_parts[in_id + 1] - self.in_parts[in_id]
                row.append(linear_cls(in_dim, out_dim, bias=bias and in_id == in_splits - 1, **kwargs))
            self.linears.append(row)
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_: torch.Tensor | Sequence[torch.Tensor]) -> TileOutput | list[TileOutput]:
        if self.in_splits > 1 and not self.input_is_already_split:
            parts = partition_uniform(input_.shape[-1], self.in_splits)
            inputs = self._split_global_input(input_, [parts[p + 1] - parts[p] for p in range(self.in_splits)])
        elif self.in_splits > 1:
            inputs = input_
            if len(inputs) != self.in_splits:
                raise ValueError(f"TiledLinear: expected {self.in_splits} input splits, got {len(inputs)}")
        else:
            inputs = [input_]
        outputs: list[TileOutput | None] = [None] * self.out_splits
        for out_id in range(self.out_splits):
            for in_id in range(self.in_splits):
                local = self.linears[out_id][in_id](inputs[in_id])
                outputs[out_id] = self._reduce_local_output(in_id, out_id, outputs[out_id], local)
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    def _split_global_input(self, input_: torch.Tensor, split_sizes: list[int]) -> tuple[torch.Tensor, ...]:
        """Cut the input along its last dimension (subclasses with other input types override this)."""
        return split_tensor_along_last_dim(input_, split_sizes)

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: TileOutput | None,
                             new_out: TileOutput) -> TileOutput:
        """Sum the tile outputs of one output split (the first is cloned: a tile's output may be a view)."""
        return new_out.clone() if current_out is None else current_out + new_out

    def _combine_output_splits(self, outputs: list[TileOutput]) -> TileOutput:
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: torch.nn.Module) -> None:
        """Copy ``other.weight`` (``out_features x in_features``) and ``other.bias`` into the tiles. Under
        ZeRO-3 it is collective: every rank must call it, and rank 0's values are kept."""
        with GatheredParameters([p for p in (getattr(other, "weight", None), getattr(other, "bias", None))
                                 if isinstance(p, torch.nn.Parameter)]):
            if tuple(other.weight.shape) != (self.out_features, self.in_features):
                raise ValueError(f"copy_params_from: weight of shape {tuple(other.weight.shape)}, expected "
                                 f"{(self.out_features, self.in_features)}")
            if self.use_bias != (getattr(other, "bias", None) is not None):
                raise ValueError(f"copy_params_from: this layer has bias={self.use_bias}, the other "
                                 f"{'has' if getattr(other, 'bias', None) is not None else 'has no'} bias")
            for row in range(self.out_splits):
                r0, r1 = self.out_parts[row], self.out_parts[row + 1]
                for col in range(self.in_splits):
                    c0, c1 = self.in_parts[col], self.in_parts[col + 1]
                    local = self.linears[row][col]
                    with GatheredParameters(local.weight, modifier_rank=0):
                        local.weight.copy_(other.weight[r0:r1, c0:c1])
                    if local.bias is not None:
                        with GatheredParameters(local.bias, modifier_rank=0):
                            local.bias.copy_(other.bias[r0:r1])


class TiledLinearReturnBias(TiledLinear):
    """Tiles of a ``linear_cls`` that returns ``(output, bias)`` (Megatron-LM's style): outputs are summed over
    the input splits and the bias is passed along; the result is ``(output, bias or None)``."""

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: TileOutput | None,
                             new_out: TileOutput) -> TileOutput:
        if not (isinstance(new_out, tuple) and len(new_out) == 2 and new_out[0] is not None):
            raise ValueError("TiledLinearReturnBias: linear_cls must return (output, bias)")
        old_tensor, old_bias = current_out if current_out is not None else (None, None)
        tensor, bias = new_out
        tensor = super()._reduce_local_output(in_id, out_id, old_tensor, tensor)
        return tensor, bias if bias is not None else old_bias

    def _combine_output_splits(self, outputs: list[TileOutput]) -> TileOutput:
        tensor = super()._combine_output_splits([o[0] for o in outputs])
        biases = [o[1] for o in outputs if o[1] is not None]
        return tensor, (super()._combine_output_splits(biases) if biases else None)
