"""The 1-bit compressed all-reduce of 1-bit Adam, 0/1 Adam and 1-bit LAMB, built from two collectives every
backend has (``all_to_all_single`` and ``all_gather``), on the CPU (gloo) and on CUDA (NCCL) alike.

A vector of ``numel`` fp32 elements is cut into N equal **chunks** (N = the group's size; rank r *serves*
chunk r, elements ``[r * chunk, (r + 1) * chunk)``) and every chunk into **blocks** of ``block`` elements (the
last block of a chunk may be shorter), each of which gets one scale:

1. **worker** (every rank): ``y = x + worker_error``; per block ``scale = ||y_block|| / sqrt(n_block)`` (the
   RMS over the block's real elements); the block is sent as its signs (bit 1 for ``y >= 0``, as DeepSpeed
   sends a sign of exactly 0 as +1) and its scale; ``worker_error = y - sign(y) * scale`` is what was not
   sent, added to the next call's input (error feedback).
2. **phase 1**: one ``all_to_all_single`` of uint8 messages (each chunk's packed sign bits, 1 bit per element,
   followed by its block scales as 4 bytes each): rank r receives every rank's copy of chunk r.
3. **server** (rank r, for chunk r): ``z = mean over ranks of (sign * scale) + server_error``; compressed the
   same way, ``server_error = z - sign(z) * server_scale``.
4. **phase 2**: one ``all_gather`` of the servers' messages; every rank decodes the whole vector, and every rank
   gets the same result.

**Padding.** Any length and any N work: the vector is padded to ``N * chunk`` elements and each chunk's
bits to whole bytes. Elements past ``numel`` are *known zeros*: they decode to 0, count in no scale and keep
zero error, so padding never leaks into the result or into the error buffers. (DeepSpeed instead pads every
tensor to a multiple of ``8 * lcm(N, 8)``, feeds the padding through the compressor like real elements, and
keeps one scale per tensor on the worker and one per chunk on the server.)

Bytes on the wire per rank and call, with ``m = ceil(chunk / 8) + 4 * ceil(chunk / block)``: ``(N - 1) * m``
in phase 1 and ``(N - 1) * m`` in phase 2, about ``2 (N-1)/N * numel / 8 * (1 + 32 / block)`` — 1/31.5 of
an fp32 ring all-reduce (``2 (N-1)/N * 4 * numel``) with the default ``block`` of 2048. The comms logger
counts exactly these uint8 messages.

The worker error has ``numel`` elements on every rank; the server error has ``chunk`` elements on its
server (:func:`error_sizes`). :func:`merge_server_errors` / :func:`split_server_error` re-cut the servers'
errors for another world size (checkpoint resharding).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsrun.config.optim import ONE_BIT_BACKENDS
from dsrun.utils.errors import ConfigError, Problem, show

from . import comm

SCALE_BLOCK = 2048  # elements per scale: 32 bits of scale per 2048 bits of signs
# DeepSpeed's comm_backend_name values; every one of them runs this all-reduce over the run's own
# torch.distributed backend (gloo on the CPU, NCCL on CUDA), which holds the device tensors directly.
BACKEND_NAMES = ONE_BIT_BACKENDS

_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)
_SHIFTS = (7, 6, 5, 4, 3, 2, 1, 0)


def check_backend_name(name: object, key: str = "optimizer.params.comm_backend_name") -> str:
    """``name`` (the config value as written, any type) lower-cased when it is one of DeepSpeed's
    ``comm_backend_name`` values; else a ConfigError."""
    if isinstance(name, str) and name.lower() in BACKEND_NAMES:
        return name.lower()
    raise ConfigError(Problem(key, f"got {show(name)}; allowed: {', '.join(BACKEND_NAMES)}",
                              "each runs dsrun's compressed all-reduce over the run's backend (gloo on the CPU, "
                              "NCCL on CUDA); \"nccl\" is DeepSpeed's default"))


# --- sign bits ------------------------------------------------------------------------------------------
def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """Bit 1 for ``values >= 0``, 8 elements per byte (first element in the highest bit), along the last
    dimension; a last dimension that is not a multiple of 8 is padded with 1 bits."""
    return _pack(values >= 0)


def _pack(positive: torch.Tensor) -> torch.Tensor:
    bits = positive.to(torch.uint8)
    n = bits.shape[-1]
    if n % 8:
        bits = torch.cat([bits, bits.new_ones(*bits.shape[:-1], 8 - n % 8)], dim=-1)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=bits.device)
    return (bits.view(*bits.shape[:-1], -1, 8) * weights).sum(dim=-1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` signs of :func:`pack_signs`'s bytes (last dimension), as +1.0 / -1.0 (fp32)."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.uint8, device=packed.device)
    bits = torch.bitwise_right_shift(packed.unsqueeze(-1), shifts).bitwise_and_(1)
    bits = bits.view(*packed.shape[:-1], -1)[..., :n]
    return bits.to(torch.float32).mul_(2.0).sub_(1.0)


# --- layout ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CompressedLayout:
    """How a vector of ``numel`` elements is cut for ``world_size`` servers: ``chunk`` elements per server
    (``world_size * chunk >= numel``), ``block`` elements per scale."""

    numel: int
    world_size: int
    chunk: int
    block: int

    @classmethod
    def of(cls, numel: int, world_size: int, chunk: int | None = None, block: int = SCALE_BLOCK) -> "CompressedLayout":
        """The layout of ``numel`` elements; ``chunk`` defaults to ``ceil(numel / world_size)`` (ZeRO stage 1
        passes its partition size, so rank r serves exactly its partition)."""
        if chunk is None:
            chunk = max(1, -(-numel // world_size))
        if chunk < 1 or chunk * world_size < numel or block < 1:
            raise ValueError(f"bad compressed layout: {numel} elements in {world_size} chunks of {chunk}, block {block}")
        return cls(numel=numel, world_size=world_size, chunk=chunk, block=min(block, chunk))

    @property
    def blocks(self) -> int:
        """Scales per chunk."""
        return -(-self.chunk // self.block)

    @property
    def sign_bytes(self) -> int:
        return -(-self.chunk // 8)

    @property
    def message_bytes(self) -> int:
        """One chunk on the wire: its sign bits, then its block scales (fp32)."""
        return self.sign_bytes + 4 * self.blocks

    def valid(self, server: int) -> int:
        """Real elements in chunk ``server`` (the rest is padding)."""
        return min(self.chunk, max(0, self.numel - server * self.chunk))

    def traffic_bytes(self) -> int:
        """Bytes this rank sends per all-reduce (both phases), as the comms logger counts them."""
        return 2 * (self.world_size - 1) * self.message_bytes


def error_sizes(layout: CompressedLayout) -> tuple[int, int]:
    """Elements of (the worker error on every rank, the server error on each server)."""
    return layout.numel, layout.chunk


# --- the all-reduce -------------------------------------------------------------------------------------
@dataclass
class CompressedResult:
    """The all-reduce's output: every server's message (``world_size x message_bytes`` uint8) and this rank's
    own chunk decoded. Both decode to the same values on every rank."""

    layout: CompressedLayout
    messages: torch.Tensor
    own_chunk: torch.Tensor
    _engine: "CompressedAllreduce"

    def decode(self) -> torch.Tensor:
        """The whole reduced vector (``numel`` fp32 elements)."""
        return self._engine.decode(self.messages)


class CompressedAllreduce:
    """The compressed all-reduce of one :class:`CompressedLayout` over one process group (None: the world).

    ``__call__(x, worker_error, server_error)`` returns the mean over ranks of ``x`` through 1-bit compression
    with error feedback on both sides, updating both error buffers in place (module docstring)."""

    def __init__(self, layout: CompressedLayout, group: comm.ProcessGroup = None, device: torch.device | str = "cpu"):
        if comm.get_world_size(group) != layout.world_size:
            raise ValueError(f"layout for {layout.world_size} ranks used on a group of {comm.get_world_size(group)}")
        self.layout, self.group, self.device = layout, group, torch.device(device)
        self.rank = comm.get_rank(group)
        L = layout
        position = torch.arange(L.world_size * L.chunk, device=self.device).view(L.world_size, L.chunk)
        self.valid = (position < L.numel).to(torch.float32)  # 1 for real elements, 0 for padding
        first = torch.arange(L.blocks, device=self.device) * L.block
        block_len = (L.chunk - first).clamp(max=L.block)
        real = torch.tensor([L.valid(r) for r in range(L.world_size)], device=self.device)
        self.counts = (real[:, None] - first[None, :]).clamp(min=0).minimum(block_len[None, :]).to(torch.float32)

    # block-wise helpers on [rows, chunk] tensors
    def _scales(self, values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        L = self.layout
        padded = values.new_zeros(values.shape[0], L.blocks * L.block)
        padded[:, :L.chunk] = values
        sumsq = padded.view(values.shape[0], L.blocks, L.block).square().sum(dim=-1)
        return (sumsq / counts.clamp(min=1.0)).sqrt_()

    def _expand(self, scales: torch.Tensor) -> torch.Tensor:
        return scales.repeat_interleave(self.layout.block, dim=-1)[:, :self.layout.chunk]

    def _compress(self, values: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """(what the receiver will decode, the uint8 messages) for rows of ``chunk`` elements."""
        scales = self._scales(values * valid, counts)
        positive = values >= 0
        decoded = positive.to(torch.float32).mul_(2.0).sub_(1.0).mul_(self._expand(scales)).mul_(valid)
        message = torch.cat([_pack(positive), scales.contiguous().view(torch.uint8)], dim=1)
        return decoded, message

    def _unpack(self, messages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        L = self.layout
        signs = unpack_signs(messages[:, :L.sign_bytes], L.chunk)
        raw = torch.empty(messages.shape[0], 4 * L.blocks, dtype=torch.uint8, device=messages.device)
        scales = raw.copy_(messages[:, L.sign_bytes:]).view(torch.float32)  # copied: aligned for the view
        return signs, scales

    def decode(self, messages: torch.Tensor) -> torch.Tensor:
        signs, scales = self._unpack(messages)
        return (signs * self._expand(scales) * self.valid).view(-1)[:self.layout.numel]

    def __call__(self, x: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor) -> CompressedResult:
        L = self.layout
        if x.numel() != L.numel or worker_error.numel() != L.numel or server_error.numel() != L.chunk:
            raise ValueError(f"compressed all-reduce of {L.numel} elements (chunk {L.chunk}) got x={x.numel()}, "
                             f"worker_error={worker_error.numel()}, server_error={server_error.numel()}")
        # worker: compensate, compress every chunk, keep what was not sent
        y = x.new_zeros(L.world_size * L.chunk, dtype=torch.float32)
        y[:L.numel] = x.reshape(-1)
        y[:L.numel] += worker_error.reshape(-1)
        y = y.view(L.world_size, L.chunk)
        decoded, outgoing = self._compress(y, self.valid, self.counts)
        worker_error.view(-1).copy_((y - decoded).view(-1)[:L.numel])
        # phase 1: chunk r of every rank to rank r
        incoming = torch.empty_like(outgoing)
        if L.world_size > 1:
            comm.all_to_all_single(incoming, outgoing, group=self.group)
        else:
            incoming.copy_(outgoing)
        # server: average the decoded copies of this rank's chunk, compensate, compress again
        signs, scales = self._unpack(incoming)
        valid, counts = self.valid[self.rank:self.rank + 1], self.counts[self.rank:self.rank + 1]
        z = (signs * self._expand(scales / L.world_size)).sum(dim=0) * valid[0] + server_error.view(-1)
        served, message = self._compress(z[None], valid, counts)
        server_error.view(-1).copy_(z - served[0])
        # phase 2: every server's chunk to every rank
        messages = torch.empty(L.world_size, L.message_bytes, dtype=torch.uint8, device=message.device)
        if L.world_size > 1:
            comm.all_gather_into_tensor(messages.view(-1), message.view(-1), group=self.group)
        else:
            messages.copy_(message)
        return CompressedResult(L, messages, served[0], self)


class CompressedBackend:
    """DeepSpeed's ``CompressedBackend`` interface over a process group: ``compressed_allreduce(buffer_m,
    worker_error, server_error, local_rank)`` returns the compressed mean of ``buffer_m`` (same shape) and
    updates both error buffers in place. Here ``worker_error`` has ``buffer_m.numel()`` elements and
    ``server_error`` ``ceil(numel / size)`` (DeepSpeed's are padded; see :func:`error_sizes`)."""

    def __init__(self, group: comm.ProcessGroup = None, block: int = SCALE_BLOCK,
                 device: torch.device | str | None = None):
        self.group = group
        self.size = comm.get_world_size(group)
        self.rank = comm.get_rank(group)
        self.block = block
        self.device = device
        self._engines: dict[tuple[int, int | None, str], CompressedAllreduce] = {}

    def layout(self, numel: int, chunk: int | None = None) -> CompressedLayout:
        return CompressedLayout.of(numel, self.size, chunk, self.block)

    def engine(self, numel: int, chunk: int | None = None, device: torch.device | str | None = None
               ) -> CompressedAllreduce:
        """The (cached) all-reduce of ``numel`` elements in chunks of ``chunk``."""
        device = torch.device(device or self.device or "cpu")
        key = (numel, chunk, str(device))
        if key not in self._engines:
            self._engines[key] = CompressedAllreduce(self.layout(numel, chunk), self.group, device)
        return self._engines[key]

    def compressed_allreduce(self, buffer_m: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                             local_rank: int | None = None) -> torch.Tensor:
        result = self.engine(buffer_m.numel(), device=buffer_m.device)(buffer_m, worker_error, server_error)
        return result.decode().view_as(buffer_m).to(buffer_m.dtype)


# --- checkpoints: the servers' errors for another world size --------------------------------------------
def merge_server_errors(server_errors: list[torch.Tensor], numel: int) -> torch.Tensor:
    """The servers' errors (rank order) laid end to end: one value per element of the vector."""
    return torch.cat([e.reshape(-1).float().cpu() for e in server_errors])[:numel]


def split_server_error(full: torch.Tensor, layout: CompressedLayout, server: int) -> torch.Tensor:
    """Server ``server``'s piece of a merged error, zero-padded to ``layout.chunk`` elements."""
    out = torch.zeros(layout.chunk, dtype=torch.float32)
    start = server * layout.chunk
    n = layout.valid(server)
    if n:
        out[:n] = full.reshape(-1)[start:start + n]
    return out


def wire_ratio(layout: CompressedLayout, element_bytes: int = 4) -> float:
    """Bytes this all-reduce sends over the bytes a ring all-reduce of the same elements would send."""
    n = layout.world_size
    if n == 1:
        return 0.0
    return layout.traffic_bytes() / (2 * (n - 1) / n * element_bytes * layout.numel)


__all__ = ["BACKEND_NAMES", "SCALE_BLOCK", "CompressedAllreduce", "CompressedBackend", "CompressedLayout",
           "CompressedResult", "check_backend_name", "error_sizes", "merge_server_errors", "pack_signs",
           "split_server_error", "unpack_signs", "wire_ratio"]
