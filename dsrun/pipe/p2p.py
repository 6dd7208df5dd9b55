"""Messages between pipeline stages: every message carries its own shape and dtype metadata.

A message is a tensor or a tuple of tensors (activations forward, their gradients backward, where a
gradient may be None). It travels as a fixed-size int64 header -- kind, micro-batch, structure, and per
tensor: present, dtype, requires_grad, shape -- followed by one payload per present tensor. Because every
message describes itself, a stage can send int64 token ids next to float activations, change the sequence
length from one micro-batch to the next, or pass a float tensor that needs no gradient, without the
receiver guessing (the hangs and wrong buffers of DeepSpeed's first-message shape cache).

:func:`exchange` posts all of a step's messages at once through :func:`dsrun.comm.batch_isend_irecv`: first
every header, then every payload. Within a batch, sends and receives are ordered by kind (activations
before gradients), so two ranks that message each other in the same step match on NCCL (by order) as on
gloo (by tag). The micro-batch id in the header lets the engine check that labels, activations and
gradients belong to the same micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, Union

import torch

from dsrun import comm
from dsrun.comm.comm import ProcessGroup

MAX_TENSORS = 16
MAX_DIMS = 8
_FIELDS = 4 + MAX_DIMS  # present, dtype, requires_grad, ndim, dims...
HEADER_LEN = 4 + MAX_TENSORS * _FIELDS  # magic, kind, micro-batch, structure (-1: one tensor, else count)
MAGIC = 0x5049_5045  # "PIPE"
ACTIVATION, GRAD = 1, 2

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}


def _tag(kind: int, payload: bool) -> int:
    return 2 * kind + int(payload)


# a message's payload: a tensor, or a tuple (or list) of tensors in which an item may be None
Message = Union[torch.Tensor, tuple[Union[torch.Tensor, None], ...], list[Union[torch.Tensor, None]]]


class _Work(Protocol):
    def wait(self) -> object: ...


@dataclass
class Outgoing:
    """A message to send: ``tensors`` (a tensor, or a tuple whose items may be None) to global rank ``peer``."""

    kind: int
    peer: int
    tensors: Message
    micro_batch_id: int


@dataclass
class Incoming:
    """A message to receive from global rank ``peer``; :func:`exchange` fills ``value`` and ``micro_batch_id``."""

    kind: int
    peer: int
    value: Message | None = None
    micro_batch_id: int = -1
    _specs: list = field(default_factory=list)
    _single: bool = False


def _items(value: Message) -> tuple[list[torch.Tensor | None], bool]:
    if isinstance(value, (tuple, list)):
        return list(value), False
    return [value], True


def encode_header(kind: int, micro_batch_id: int, value: Message, device: torch.device) -> torch.Tensor:
    items, single = _items(value)
    if len(items) > MAX_TENSORS:
        raise ValueError(f"a pipeline message holds at most {MAX_TENSORS} tensors; got {len(items)}")
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[:4] = torch.tensor([MAGIC, kind, micro_batch_id, -1 if single else len(items)])
    for i, item in enumerate(items):
        base = 4 + i * _FIELDS
        if item is None:
            continue
        if not torch.is_tensor(item):
            raise TypeError(f"pipeline stages exchange tensors (or tuples of tensors); item {i} is "
                            f"{type(item).__name__}")
        if item.dtype not in _CODE or item.dim() > MAX_DIMS:
            raise ValueError(f"cannot send a {item.dtype} tensor of {item.dim()} dims between stages "
                             f"(dtypes: {', '.join(str(d) for d in DTYPES)}; at most {MAX_DIMS} dims)")
        header[base:base + 4] = torch.tensor([1, _CODE[item.dtype], int(item.requires_grad), item.dim()])
        header[base + 4:base + 4 + item.dim()] = torch.tensor(list(item.shape), dtype=torch.int64)
    return header.to(device)


def decode_header(header: torch.Tensor) -> tuple[int, int, bool, list[tuple[torch.dtype, tuple[int, ...], bool] | None]]:
    values = header.tolist()
    if values[0] != MAGIC:
        raise RuntimeError("pipeline message out of step: expected a header (the stages run different schedules?)")
    kind, micro_batch_id, structure = values[1], values[2], values[3]
    count = 1 if structure == -1 else structure
    specs: list[tuple[torch.dtype, tuple[int, ...], bool] | None] = []
    for i in range(count):
        base = 4 + i * _FIELDS
        present, code, grad, ndim = values[base:base + 4]
        specs.append((DTYPES[code], tuple(values[base + 4:base + 4 + ndim]), bool(grad)) if present else None)
    return kind, micro_batch_id, structure == -1, specs


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """What goes on the wire: contiguous, bools as bytes (NCCL has no bool)."""
    tensor = tensor.detach()
    if tensor.dtype == torch.bool:
        tensor = tensor.to(torch.uint8)
    return tensor.contiguous()


@dataclass(frozen=True)
class Split:
    """Send only this model-parallel rank's 1/size of each payload and all-gather the rest over ``group`` on
    arrival (``pipeline.pipe_partitioned`` / ``grad_partitioned`` with a model axis: the model-parallel ranks
    of a stage hold the same activations, so each moves a slice)."""

    group: ProcessGroup
    size: int
    rank: int

    def piece(self, numel: int) -> int:
        return -(-numel // self.size)

    def cut(self, wire: torch.Tensor) -> torch.Tensor:
        flat, n = wire.reshape(-1), wire.numel()
        size = self.piece(n)
        out = torch.zeros(size, dtype=wire.dtype, device=wire.device)
        part = flat[self.rank * size:min(n, (self.rank + 1) * size)]
        out[:part.numel()] = part
        return out

    def join(self, piece: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        full = torch.empty(piece.numel() * self.size, dtype=piece.dtype, device=piece.device)
        comm.all_gather_into_tensor(full, piece, group=self.group)
        numel = 1
        for dim in shape:
            numel *= dim
        return full[:numel].view(shape)


def _wait(works: Sequence[_Work | None]) -> None:
    for work in works:
        if work is not None:
            work.wait()


def exchange(outgoing: Sequence[Outgoing], incoming: Sequence[Incoming], device: torch.device,
             split: dict[int, Split] | None = None) -> None:
    """Send every ``outgoing`` message and receive every ``incoming`` one (filled in place); messages of a
    kind in ``split`` move a model-parallel slice each (:class:`Split`)."""
    split = split or {}
    sends = sorted(outgoing, key=lambda m: m.kind)
    recvs = sorted(incoming, key=lambda m: m.kind)
    ops, headers = [], []
    for msg in sends:
        ops.append(comm.send_op(encode_header(msg.kind, msg.micro_batch_id, msg.tensors, device), msg.peer,
                               tag=_tag(msg.kind, False)))
    for msg in recvs:
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
        headers.append(header)
        ops.append(comm.recv_op(header, msg.peer, tag=_tag(msg.kind, False)))
    _wait(comm.batch_isend_irecv(ops))

    ops, keep = [], []
    for msg in sends:
        for item in _items(msg.tensors)[0]:
            if item is not None:
                wire = _wire(item)
                if msg.kind in split:
                    wire = split[msg.kind].cut(wire)
                keep.append(wire)
                ops.append(comm.send_op(wire, msg.peer, tag=_tag(msg.kind, True)))
    buffers: list[list[torch.Tensor | None]] = []
    for msg, header in zip(recvs, headers):
        kind, msg.micro_batch_id, msg._single, msg._specs = decode_header(header)
        if kind != msg.kind:
            raise RuntimeError(f"pipeline message out of step: expected kind {msg.kind}, got {kind}")
        row: list[torch.Tensor | None] = []
        for spec in msg._specs:
            if spec is None:
                row.append(None)
                continue
            dtype, shape, _ = spec
            wire_dtype = torch.uint8 if dtype == torch.bool else dtype
            if msg.kind in split:
                numel = 1
                for dim in shape:
                    numel *= dim
                wire = torch.empty(split[msg.kind].piece(numel), dtype=wire_dtype, device=device)
            else:
                wire = torch.empty(shape, dtype=wire_dtype, device=device)
            row.append(wire)
            ops.append(comm.recv_op(wire, msg.peer, tag=_tag(msg.kind, True)))
        buffers.append(row)
    _wait(comm.batch_isend_irecv(ops))

    for msg, row in zip(recvs, buffers):
        values = []
        for spec, wire in zip(msg._specs, row):
            if spec is None:
                values.append(None)
                continue
            dtype, shape, requires_grad = spec
            if msg.kind in split:
                wire = split[msg.kind].join(wire, shape)
            tensor = wire.to(torch.bool) if dtype == torch.bool else wire
            if requires_grad and tensor.is_floating_point():
                tensor.requires_grad_(True)
            values.append(tensor)
        msg.value = values[0] if msg._single else tuple(values)
