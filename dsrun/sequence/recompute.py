"""Keep the input of a sequence-parallel exchange for backward instead of its output.

Ulysses' second all-to-all turns the attention output (whole sequence, 1/P of the heads) back into this rank's
sequence slice with every head, and the output projection that follows saves that exchanged tensor for its
weight gradient. The attention saved its own output already, and the exchange only moves bytes, so keeping both
holds one ``[batch, seq/P, width]`` tensor per layer that one process would not hold (there the projection's
input *is* the attention output). :class:`ExchangedFromSource` drops it: while active, a tensor autograd saves
that lies in the exchanged output's storage is stored as the exchange's input, and backward gets it back by
running the exchange again (one more all-to-all of the same size per layer, in backward).

It composes with any saved-tensor hooks already active (an activation checkpoint, a memory counter): what it
stores goes through them, in the order the operations save, so a checkpoint's recompute matches its forward.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch
from torch.autograd.graph import saved_tensors_hooks


_T = TypeVar("_T")


def _identity(x: _T) -> _T:
    return x


class _FromSource:
    """What autograd stores in place of a view of the exchanged output: the (outer-packed) source and the
    view's geometry. ``source`` is whatever the outer pack hook made of the source tensor (any object)."""

    __slots__ = ("source", "size", "stride", "offset")

    def __init__(self, source: object, view: torch.Tensor):
        self.source, self.size, self.stride, self.offset = source, view.size(), view.stride(), view.storage_offset()


class ExchangedFromSource(saved_tensors_hooks):
    """Saved-tensor hooks under which views of ``exchanged`` (the output of ``redo(source)``) are saved as
    ``source`` and rebuilt in backward by ``redo(source)``, which must make a tensor of ``exchanged``'s exact
    layout (it runs without gradient, on the same ranks in the same order as every rank's backward)."""

    def __init__(self, exchanged: torch.Tensor, source: torch.Tensor,
                 redo: Callable[[torch.Tensor], torch.Tensor]) -> None:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._outer_pack, self._outer_unpack = top if top is not None else (_identity, _identity)
        self._storage = exchanged.untyped_storage().data_ptr()
        self._layout = (exchanged.size(), exchanged.stride(), exchanged.storage_offset())
        self._device, self._redo = exchanged.device, redo
        self._source: torch.Tensor | None = source.detach()
        super().__init__(self._pack, self._unpack)

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._source = None  # the graph keeps these hooks: hold the source only through what was packed

    def _pack(self, tensor: torch.Tensor) -> Any:
        if self._source is not None and tensor.device == self._device \
                and tensor.untyped_storage().data_ptr() == self._storage:
            return _FromSource(self._outer_pack(self._source), tensor)
        return self._outer_pack(tensor)

    def _unpack(self, packed: object) -> torch.Tensor:
        """``packed``: a _FromSource, or whatever the outer pack hook returned (any object)."""
        if not isinstance(packed, _FromSource):
            return self._outer_unpack(packed)
        with torch.no_grad():
            fresh = self._redo(self._outer_unpack(packed.source))
        if (fresh.size(), fresh.stride(), fresh.storage_offset()) != self._layout:
            raise RuntimeError(f"the recomputed exchange has layout {fresh.size()}/{fresh.stride()}, the forward's "
                               f"{self._layout[0]}/{self._layout[1]}: redo must repeat the forward's operations")
        return fresh.as_strided(packed.size, packed.stride, packed.offset)
