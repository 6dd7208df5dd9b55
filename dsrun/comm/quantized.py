"""ZeRO++'s quantized collectives: block-quantized INT8 weight all-gather (qwZ) and INT4/INT8 gradient
reduce-scatter through quantized all-to-all (qgZ), on any backend that has ``all_gather_into_tensor`` and
``all_to_all_single`` (gloo on the CPU, NCCL on CUDA).

**Quantizer.** A vector is cut into blocks of ``block`` elements (the last one may be shorter); each block
gets one fp32 scale ``s = max|x| / qmax`` (``qmax`` = 127 for INT8, 7 for INT4: symmetric, no zero point)
and its elements become ``q = round(x / s)`` in ``[-qmax, qmax]``. Dequantizing gives ``q * s``, within
``s / 2`` of ``x`` for every element (a block of zeros has ``s = 0`` and decodes to zeros exactly).

**Message.** One uint8 tensor per vector of ``n`` elements: the codes (INT8: ``n`` bytes; INT4: two codes
per byte, ``ceil(n / 2)`` bytes, code + 8 in each nibble, the first element in the high nibble) followed
by the ``ceil(n / block)`` scales as 4 bytes each (:func:`message_bytes`). These are the bytes the comms
logger counts: about 1/4 of fp32 (1/2 of bf16) for INT8, 1/8 of fp32 for INT4, plus ``4 / block`` per element.

**qwZ** (:func:`quantized_all_gather_into_tensor`): every rank quantizes its shard, the messages are
all-gathered, every rank decodes all of them into the gathered buffer (in the buffer's dtype). The shards
(and the fp32 masters) are never touched: only the gathered compute copy carries the quantization error.

**qgZ** (:class:`QuantizedReduceScatter`): the hierarchical all-to-all of the ZeRO++ paper. With ``L``
ranks per node and ``M`` nodes (rank = node * L + local): (1) each rank quantizes, for every local index
``l``, the M chunks owned by the ranks ``m * L + l``, and one all-to-all inside the node sends them to local
rank ``l``; (2) that rank dequantizes and sums what its L node-mates sent (the node's partial sums of the M
chunks it serves), re-quantizes them per destination node and (3) one all-to-all across nodes (the ranks
with the same local index) delivers each chunk to its owner, who dequantizes and sums. On one node (M = 1)
stage 3 collapses: one quantized all-to-all, then dequantize and sum.

**LoCo** (:class:`LocoFeedback`, ``zeropp_loco_param``: ``{"err_beta": b, "reset_T": T}``) adds error feedback
to each quantization of the reduce-scatter, as DeepSpeed's LoCo kernels do: before quantizing, the value gets
the error buffer of that message added (``v = x + e``); after, the buffer becomes ``e = b * e + (1 - b) * (v -
deQ(Q(v)))``. Stage 1 keeps one buffer the size of the rows, stage 2 (hierarchical only) one the size of the
node's partial sums. With ``b = 0`` the error a step leaves is sent with the next one, so the sum of T steps'
outputs is off by one quantization error instead of T. The buffers live between steps as INT8 blocks (what
DeepSpeed keeps too), one pair per bucket of parameters (its ``key``); a bucket's buffers start from zero
after ``reset_T`` uses, when its values overflow (inf/nan: DeepSpeed drops them on an fp16 overflow), and are
scaled with the loss scale when it changes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from . import comm
from .groups import ProcessGroups

WEIGHT_BLOCK = 256  # qwZ: elements per scale (4 bytes of scale per 256 bytes of INT8 codes)
GRAD_BLOCK = 256  # qgZ: elements per scale
QMAX = {8: 127, 4: 7}


def _check_bits(bits: int) -> int:
    if bits not in QMAX:
        raise ValueError(f"quantization bits must be 4 or 8, got {bits}")
    return bits


def code_bytes(n: int, bits: int) -> int:
    """Bytes of the codes of ``n`` elements."""
    return n if _check_bits(bits) == 8 else (n + 1) // 2


def message_bytes(n: int, bits: int, block: int) -> int:
    """Bytes on the wire for a vector of ``n`` elements: codes then one fp32 scale per block."""
    return code_bytes(n, bits) + 4 * (-(-n // block) if n else 0)


def quantize(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (int8, one per element, ``x``'s shape flattened) and scales (fp32, one per block) of ``x``."""
    qmax = QMAX[_check_bits(bits)]
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    nblocks = -(-n // block) if n else 0
    padded = flat.new_zeros(nblocks * block)
    padded[:n] = flat
    blocks = padded.view(nblocks, block)
    scales = blocks.abs().amax(dim=1) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(blocks / safe[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return codes.reshape(-1)[:n], scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 values ``code * scale`` of the codes (int8, one per element) and their blocks' scales."""
    n = codes.numel()
    per_element = scales.repeat_interleave(block)[:n]
    return codes.float() * per_element


def encode(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """The uint8 message of ``x`` (see the module docstring)."""
    codes, scales = quantize(x, bits, block)
    if bits == 4:
        nibbles = (codes.to(torch.int16) + 8).to(torch.uint8)
        if nibbles.numel() % 2:
            nibbles = torch.cat([nibbles, nibbles.new_full((1,), 8)])
        pairs = nibbles.view(-1, 2)
        body = pairs[:, 0] * 16 + pairs[:, 1]
    else:
        body = codes.view(torch.uint8)
    return torch.cat([body, scales.view(torch.uint8)])


def decode(message: torch.Tensor, n: int, bits: int, block: int) -> torch.Tensor:
    """fp32 values of a message of ``n`` elements made by :func:`encode`."""
    size = code_bytes(n, bits)
    body, scale_bytes = message[:size], message[size:]
    scales = scale_bytes.clone().view(torch.float32)  # a fresh copy: aligned for the fp32 view
    if bits == 4:
        high = torch.div(body, 16, rounding_mode="floor")
        codes = torch.stack([high, body - high * 16], dim=1).reshape(-1)[:n].to(torch.int16) - 8
    else:
        codes = body.contiguous().view(torch.int8)
    return dequantize(codes, scales, block)


# --- qwZ ------------------------------------------------------------------------------------------------
class _DecodeOnWait:
    """A quantized all-gather in flight: :meth:`wait` waits for it, then decodes into the output buffer."""

    def __init__(self, work: dist.Work | None, output: torch.Tensor, gathered: torch.Tensor, n: int, block: int):
        self.work, self.output, self.gathered, self.n, self.block = work, output, gathered, n, block

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.gathered is not None:
            world = self.output.numel() // self.n if self.n else 0
            messages = self.gathered.view(world, -1) if world else self.gathered
            with torch.no_grad():
                for r in range(world):
                    self.output[r * self.n:(r + 1) * self.n].copy_(decode(messages[r], self.n, 8, self.block))
            self.gathered = None


def quantized_all_gather_into_tensor(output: torch.Tensor, shard: torch.Tensor, group: comm.ProcessGroup = None,
                                     async_op: bool = False, block: int = WEIGHT_BLOCK) -> Any:
    """``all_gather_into_tensor(output, shard)`` with INT8 block-quantized messages, decoded on arrival into
    ``output`` (any floating dtype). Returns a work object with ``wait()`` when ``async_op``, else None."""
    return all_gather_messages(output, encode(shard, 8, block), shard.numel(), group, async_op, block)


def all_gather_messages(output: torch.Tensor, message: torch.Tensor, n: int, group: comm.ProcessGroup = None,
                        async_op: bool = False, block: int = WEIGHT_BLOCK) -> Any:
    """All-gather every rank's INT8 ``message`` (:func:`encode` of ``n`` elements: one made now, or a shard
    kept encoded) and decode them all into ``output`` (N * n elements). Returns a work object with
    ``wait()`` when ``async_op``, else None."""
    world = comm.get_world_size(group)
    gathered = torch.empty(world * message.numel(), dtype=torch.uint8, device=message.device)
    work = comm.all_gather_into_tensor(gathered, message, group=group, async_op=async_op)
    handle = _DecodeOnWait(work if async_op else None, output, gathered, n, block)
    if not async_op:
        handle.wait()
        return None
    return handle


# --- qgZ ------------------------------------------------------------------------------------------------
@dataclass
class _ErrorBuffer:
    """One quantization's error, kept as INT8 codes and block scales (``None``: zero)."""

    codes: torch.Tensor | None = None
    scales: torch.Tensor | None = None

    def value(self, n: int, device: torch.device) -> torch.Tensor:
        if self.codes is None or self.codes.numel() != n:
            return torch.zeros(n, dtype=torch.float32, device=device)
        return dequantize(self.codes, self.scales, GRAD_BLOCK)

    def store(self, err: torch.Tensor) -> None:
        self.codes, self.scales = quantize(err, 8, GRAD_BLOCK)


@dataclass
class LocoFeedback:
    """LoCo's error feedback for qgZ (the module docstring): ``err_beta`` in [0, 1), buffers restarted after
    ``reset_T`` uses. Its state is per bucket key: stage-1 and stage-2 errors, uses, and the loss scale they
    are in."""

    err_beta: float = 0.8
    reset_T: int = 1024
    buffers: dict = field(default_factory=dict)

    def __post_init__(self):
        if not 0.0 <= float(self.err_beta) < 1.0:
            raise ValueError(f"zeropp_loco_param.err_beta must be in [0, 1), got {self.err_beta}")
        if int(self.reset_T) < 1:
            raise ValueError(f"zeropp_loco_param.reset_T must be a positive number of steps, got {self.reset_T}")

    def state(self, key: object, scale: float) -> dict:
        """The key's buffers for this use: restarted after ``reset_T`` uses, rescaled to ``scale``."""
        entry = self.buffers.get(key)
        if entry is None or entry["uses"] >= int(self.reset_T):
            entry = self.buffers[key] = {"stages": {}, "uses": 0, "scale": scale}
        elif entry["scale"] != scale:
            ratio = scale / entry["scale"]
            for buf in entry["stages"].values():
                if buf.scales is not None:
                    buf.scales = buf.scales * ratio
            entry["scale"] = scale
        entry["uses"] += 1
        return entry

    def encode_with_feedback(self, entry: dict, stage: str, slabs: torch.Tensor, bits: int, block: int) -> torch.Tensor:
        """The messages of ``slabs`` ((P, n): one per peer) with the stage's error added before quantizing;
        the buffer then takes this quantization's error (what the peers will decode, exactly)."""
        peers, n = slabs.shape
        buf = entry["stages"].setdefault(stage, _ErrorBuffer())
        err = buf.value(peers * n, slabs.device).view(peers, n)
        v = slabs.float() + err
        messages = torch.stack([encode(v[p], bits, block) for p in range(peers)])
        if not bool(torch.isfinite(v).all()):  # an overflowing step: its error is no use to the next one
            entry["stages"][stage] = _ErrorBuffer()
            return messages
        new = v - torch.stack([decode(messages[p], n, bits, block) for p in range(peers)])
        beta = float(self.err_beta)
        buf.store(new if beta == 0 else beta * err + (1.0 - beta) * new)
        return messages

    def nbytes(self) -> int:
        """Bytes of the INT8 error buffers held."""
        return sum(b.codes.numel() + 4 * b.scales.numel() for e in self.buffers.values()
                   for b in e["stages"].values() if b.codes is not None)


@dataclass
class QuantizedReduceScatter:
    """Reduce-scatter over ``group`` (N ranks) through quantized all-to-all, hierarchical when an ``intra``
    group is given (N = L * M; ``intra``: this rank's L node-mates, ``inter``: the M ranks with its local index,
    None when they are the whole world). Build it with :func:`make_reduce_scatter` on every rank at once."""

    group: Any = None
    intra: Any = None
    inter: Any = None
    bits: int = 4
    block: int = GRAD_BLOCK
    loco: LocoFeedback | None = None

    @property
    def hierarchical(self) -> bool:
        """Whether it runs in two levels (inside each node, then across nodes)."""
        return self.intra is not None

    def __call__(self, output: torch.Tensor, rows: torch.Tensor, key: object = None, scale: float = 1.0) -> None:
        """``rows``: (N, C), row r for rank r; ``output`` (C elements) gets the sum over ranks of this
        rank's row, quantization error included. With LoCo, ``key`` names the bucket (the same parameters in
        the same order from step to step) whose error buffers apply, and ``scale`` is the loss scale its
        gradients carry."""
        world = comm.get_world_size(self.group)
        rows = rows.reshape(world, -1)
        entry = self.loco.state(key, scale) if self.loco is not None and key is not None else None
        if not self.hierarchical:
            out = self._exchange(rows.unsqueeze(1), self.group, entry, "intra")
        else:
            local = comm.get_world_size(self.intra)
            nodes = world // local
            by_local = rows.view(nodes, local, -1).transpose(0, 1)  # [l, m] = the row of rank m * L + l
            partial = self._exchange(by_local, self.intra, entry, "intra")  # (M, C): this node's sums for m * L + mine
            out = self._exchange(partial.unsqueeze(1), self.inter, entry, "inter")
        output.copy_(out.reshape(-1))

    def _exchange(self, slabs: torch.Tensor, group: comm.ProcessGroup, entry: dict | None = None,
                  stage: str = "") -> torch.Tensor:
        """``slabs``: (P, K, C), slab p for peer p of ``group``; returns the fp32 (K, C) sum of the slabs
        the P peers sent to this rank. ``entry``: LoCo's state for this bucket (its ``stage`` buffer applies)."""
        peers, k, c = slabs.shape
        n = k * c
        if entry is not None:
            messages = self.loco.encode_with_feedback(entry, stage, slabs.reshape(peers, n), self.bits, self.block)
        else:
            messages = torch.stack([encode(slabs[p], self.bits, self.block) for p in range(peers)])
        received = torch.empty_like(messages)
        comm.all_to_all_single(received, messages, group=group)
        total = torch.zeros(n, dtype=torch.float32, device=slabs.device)
        for p in range(peers):
            total += decode(received[p], n, self.bits, self.block)
        return total.view(k, c)


def hierarchical_node_size(group: comm.ProcessGroup = None, node_size: int | None = None) -> int | None:
    """The ranks per node of a hierarchical reduce-scatter over ``group`` (``node_size``, default: the launcher's
    ``LOCAL_WORLD_SIZE``), or None when it is one flat all-to-all: on one node, with nodes that do not divide
    it, or when ``group`` does not span the whole world (the node groups of a data group beside pipeline or
    tensor groups would differ from rank to rank of the others' groups; a MiCS shard group likewise)."""
    world = comm.get_world_size(group)
    node = int(node_size or os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    if node >= world or world % node or node < 1 or world != comm.get_world_size():
        return None
    return node


def make_reduce_scatter(group: comm.ProcessGroup = None, node_size: int | None = None, bits: int = 4,
                        block: int = GRAD_BLOCK, groups: ProcessGroups | None = None,
                        loco: LocoFeedback | None = None) -> QuantizedReduceScatter:
    """A :class:`QuantizedReduceScatter` over ``group``, hierarchical where :func:`hierarchical_node_size` says
    so. Its node and cross-node groups are the run's: ``groups`` (the engine's :class:`ProcessGroups`, whose
    data-parallel group ``group`` is then; default: the world's) cuts ``group`` into nodes
    (:meth:`ProcessGroups.shard_node_groups`: every node's group, then every cross-node group, in a fixed
    order, cached there). Collective when hierarchical: every rank of the world calls it in the same order.
    ``loco``: LoCo's error feedback (None: plain qgZ)."""
    _check_bits(bits)
    node = hierarchical_node_size(group, node_size)
    if node is None:
        return QuantizedReduceScatter(group=group, bits=bits, block=block, loco=loco)
    groups = groups if groups is not None else ProcessGroups()  # the world's: creates no group of its own
    intra, inter = groups.shard_node_groups(comm.get_world_size(group), node)
    return QuantizedReduceScatter(group=group, intra=intra, inter=inter, bits=bits, block=block, loco=loco)
