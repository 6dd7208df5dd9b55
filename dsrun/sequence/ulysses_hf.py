"""Ulysses for Hugging Face models (ALST, DeepSpeed's ``UlyssesSPAttentionHF`` and ``UlyssesSPDataLoaderAdapter`` of
``deepspeed.runtime.sequence_parallel.ulysses_sp``).

``UlyssesSPAttentionHF.register_with_transformers(model_or_name, core_attn_implementation, sequence_parallel_size,
micro_batch_size, seq_length=None, seq_length_is_variable=True)`` creates the sequence-parallel groups
(:mod:`dsrun.sequence.parallel_state_sp`, returned as the ``mpu`` for ``deepspeed.initialize``) and puts a wrapper in
place of that attention function in ``transformers``' ``ALL_ATTENTION_FUNCTIONS`` (every model using it then runs
sequence-parallel; the key stays the same, so the model's other branches on its attention implementation still
hold). The wrapper receives this rank's slice of the sequence with every head (``[bs, heads, seq / P, head_dim]``),
exchanges q, k and v into the whole sequence with ``heads / P`` heads (key/value heads repeated first when there are
fewer of them than ranks), all-gathers ``position_ids`` (required: causal masking follows them), runs the original
attention function, and exchanges its output back to ``[bs, seq / P, heads * head_dim]``. Attention masks are
dropped (a 4-D mask of the local length is wrong for the whole sequence) except flex attention's ``BlockMask``,
rebuilt causal for the whole length. ``eager`` is refused (it needs a 4-D mask); with ``disable_in_eval`` a module in
eval mode calls the original function on whatever it is given.

``UlyssesSPDataLoaderAdapter(dl, sp_rank, sp_group, sp_world_size, device)`` wraps a loader of
``{"input_ids", "position_ids", "labels", ...}`` batches ``[bs, seq, ...]``: every P-th step it takes one batch from
each rank of the group, and each rank then gets, in turn, its slice of the sequence of rank 0's batch, rank 1's,
...: so the ranks of a group process one sample together. ``labels`` become ``shift_labels`` (shifted left by one,
``-100`` at the end) before the cut, as the loss then needs no shift across ranks.
"""
from __future__ import annotations

import importlib.metadata
import re
from collections import defaultdict, deque
from typing import Any, Callable, Iterable

import torch

from dsrun import comm
from dsrun.sequence import parallel_state_sp
from dsrun.sequence.layer import _SeqAllToAll
from dsrun.utils.logging import logger

MIN_TRANSFORMERS = (4, 51, 3)
_HUB_KERNEL = re.compile(r"^[^/:]+/[^/:]+(?:@[^/:]+)?(?::[^/:]+)?$")  # e.g. kernels-community/flash-attn2


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


class UlyssesSPAttentionHF(torch.nn.Module):
    """A Hugging Face attention function run sequence-parallel over ``process_group`` (module docstring).
    ``forward(module, query, key, value, attention_mask, *args, position_ids=..., **kwargs)`` takes HF's
    ``[bs, heads, seq_local, head_dim]`` and returns ``([bs, seq_local, heads * head_dim], attn_weights)``."""

    def __init__(self, attn: Callable[..., tuple], batch_size: int, attn_head_count: int, attn_head_size: int, kv_head_count: int,
                 num_hidden_layers: int, process_group: comm.ProcessGroup, seq_length_is_variable: bool = False,
                 local_seq_length: int | None = None, global_seq_length: int | None = None,
                 disable_in_eval: bool = False) -> None:
        super().__init__()
        have = importlib.metadata.version("transformers")
        if _version(have) < MIN_TRANSFORMERS:
            raise ValueError(f"transformers>={'.'.join(map(str, MIN_TRANSFORMERS))} is required, but you have "
                             f"transformers=={have}")
        self.attn, self.process_group = attn, process_group
        self.world_size, self.sp_rank = comm.get_world_size(process_group), comm.get_rank(process_group)
        if attn_head_count % self.world_size:
            raise ValueError(f"Attention head count {attn_head_count} is not divisible by SP size {self.world_size}")
        if kv_head_count % self.world_size and self.world_size % kv_head_count:
            raise ValueError(f"KV attention head count {kv_head_count} is not divisible by SP size "
                             f"{self.world_size} or vice versa")
        self.batch_size, self.num_hidden_layers = batch_size, num_hidden_layers
        self.attn_head_count, self.attn_head_size, self.global_kv_head_count = attn_head_count, attn_head_size, kv_head_count
        self.seq_length_is_variable, self.disable_in_eval = seq_length_is_variable, disable_in_eval
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.local_q_head_count = attn_head_count // self.world_size
        # fewer kv heads than ranks: each is repeated so that every rank gets one
        self.kv_replication_factor = max(1, self.world_size // kv_head_count)
        self.local_kv_head_count = max(1, kv_head_count // self.world_size)
        self.core_attn_implementation: str | None = None  # set by register_with_transformers
        self._flex_block_mask_cached: Any = None
        self._flex_block_mask_cache_key: tuple | None = None

    def _exchange_in(self, x: torch.Tensor) -> torch.Tensor:
        """``[bs, heads, seq_local, hs]`` -> ``[bs, heads / P, seq, hs]``."""
        return _SeqAllToAll.apply(self.process_group, x.contiguous(), 1, 2)

    def _causal_block_mask(self, attention_mask: object, query: torch.Tensor) -> object:
        """Flex attention's ``BlockMask`` made for the local length, rebuilt causal for the whole sequence (cached
        per batch size and length)."""
        from torch.nn.attention.flex_attention import BlockMask, create_block_mask

        if not isinstance(attention_mask, BlockMask):
            return attention_mask
        key = (query.shape[0], query.shape[2])
        if self._flex_block_mask_cache_key != key:
            self._flex_block_mask_cached = create_block_mask(lambda b, h, q, kv: q >= kv, B=key[0], H=None,
                                                             Q_LEN=key[1], KV_LEN=key[1], device=query.device)
            self._flex_block_mask_cache_key = key
        return self._flex_block_mask_cached

    def forward(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: object, *args: object, **kwargs: object) -> tuple[torch.Tensor, object]:
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        batch, _, local, _ = query.shape
        if self.seq_length_is_variable:
            self.local_seq_length, self.global_seq_length = local, local * self.world_size
        if "position_ids" not in kwargs or kwargs["position_ids"] is None:
            raise ValueError("Ulysses SP needs position_ids in every forward() call (causal masking follows them "
                             "once the sequence is gathered): pass position_ids, e.g. from UlyssesSPDataLoaderAdapter")
        if (batch, local) != (self.batch_size, self.local_seq_length) or query.shape[1] != self.attn_head_count or \
                key.shape != value.shape or key.shape[1] != self.global_kv_head_count:
            raise ValueError(f"UlyssesSPAttentionHF: got query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                             f"{tuple(value.shape)}; expected [{self.batch_size}, {self.attn_head_count} (kv: "
                             f"{self.global_kv_head_count}), {self.local_seq_length}, {self.attn_head_size}]")
        pieces = [torch.empty_like(kwargs["position_ids"]) for _ in range(self.world_size)]
        comm.all_gather(pieces, kwargs["position_ids"].contiguous(), group=self.process_group)
        kwargs["position_ids"] = torch.cat(pieces, dim=1)
        if self.kv_replication_factor > 1:
            key = key.repeat_interleave(self.kv_replication_factor, dim=1)
            value = value.repeat_interleave(self.kv_replication_factor, dim=1)
        query, key, value = self._exchange_in(query), self._exchange_in(key), self._exchange_in(value)
        if self.kv_replication_factor > 1:
            module.num_key_value_groups = query.shape[1] // key.shape[1]
        if self.core_attn_implementation == "flex_attention":
            attention_mask = self._causal_block_mask(attention_mask, query)
        context, weights = self.attn(module, query, key, value, attention_mask, *args, **kwargs)  # [bs, seq, h/P, hs]
        output = _SeqAllToAll.apply(self.process_group, context.contiguous(), 1, 2)  # [bs, seq / P, h, hs]
        return output.reshape(batch, local, -1), weights

    @classmethod
    def register_with_transformers(cls, model_name_or_path: object, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int, seq_length: int | None = None,
                                   seq_length_is_variable: bool = True, disable_in_eval: bool = False,
                                   max_length: int | None = None) -> Any:
        """Create the sequence-parallel groups and make ``core_attn_implementation`` sequence-parallel in
        ``transformers`` (module docstring); returns the mpu (:mod:`dsrun.sequence.parallel_state_sp`), or None
        for ``sequence_parallel_size`` 1. ``model_name_or_path``: a model (or anything with ``.config``, a PEFT
        wrapper) or a name/path for ``AutoConfig``."""
        if sequence_parallel_size == 1:
            return None
        if max_length is not None:
            logger.warning("The 'max_length` argument is deprecated and will be eventually removed, please use "
                           "`seq_length` instead")
            seq_length = max_length if seq_length is None else seq_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError("Either `seq_length_is_variable` needs to be `True` or `seq_length` needs to be set to "
                             "an integer value of the fixed batch size length.")
        from transformers import AutoConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size=sequence_parallel_size)
        config = (model_name_or_path.config if hasattr(model_name_or_path, "config")
                  else AutoConfig.from_pretrained(model_name_or_path))
        configured = getattr(config, "_attn_implementation", None)
        if configured is not None and configured != core_attn_implementation:
            raise ValueError(f"core_attn_implementation='{core_attn_implementation}' does not match model config "
                             f"attn_implementation='{configured}'. Set both to the same value so sequence-parallel "
                             "wrapper can intercept the active attention path.")
        if core_attn_implementation in ("eager", "paged|eager"):
            raise ValueError(f"{core_attn_implementation} attn_implementation isn't currently supported by Ulysses "
                             "sequence parallelism because it requires a 4D attention_mask (O(n²) memory). Use any "
                             "flash attention variant, 'flex_attention', 'sdpa', or a hub-hosted kernel.")
        if isinstance(core_attn_implementation, str) and _HUB_KERNEL.search(core_attn_implementation):
            from transformers import modeling_flash_attention_utils as flash_utils  # registers the hub kernel

            flash_utils.lazy_import_flash_attention(core_attn_implementation)
        if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"{core_attn_implementation} is not a valid attn_implementation. The choices are "
                             f"{ALL_ATTENTION_FUNCTIONS.valid_keys()}")
        text = config.get_text_config()
        variable = seq_length_is_variable
        world = parallel_state_sp.get_sequence_parallel_world_size()
        uattn = cls(attn=ALL_ATTENTION_FUNCTIONS[core_attn_implementation], batch_size=micro_batch_size,
                    attn_head_count=text.num_attention_heads,
                    attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
                    kv_head_count=text.num_key_value_heads, num_hidden_layers=text.num_hidden_layers,
                    process_group=parallel_state_sp.get_sequence_parallel_group(), seq_length_is_variable=variable,
                    local_seq_length=None if variable else seq_length // world,
                    global_seq_length=None if variable else seq_length, disable_in_eval=disable_in_eval)
        uattn.core_attn_implementation = core_attn_implementation

        def uattn_wrapper(module, query, key, value, attention_mask, *args, **kwargs):
            if core_attn_implementation == "flex_attention":
                from torch.nn.attention.flex_attention import BlockMask

                keep = isinstance(attention_mask, BlockMask)
            else:
                keep = False
            return uattn(module, query, key, value, attention_mask if keep else None, *args, **kwargs)

        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = uattn_wrapper
        return parallel_state_sp


class UlyssesSPDataLoaderAdapter:
    """Shard a loader's batches over a sequence-parallel group (module docstring)."""

    def __init__(self, dl: Iterable[dict], sp_rank: int, sp_group: comm.ProcessGroup, sp_world_size: int,
                 device: torch.device | str) -> None:
        self.dl, self.sp_rank, self.sp_group, self.sp_world_size, self.device = dl, sp_rank, sp_group, sp_world_size, device
        self.iter = iter(dl)
        self.micro_batches: deque = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> "UlyssesSPDataLoaderAdapter":
        return self

    def __next__(self) -> dict:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """Gather one batch from each rank of the group and queue this rank's slice of each."""
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)  # the next epoch starts afresh
            raise
        if "position_ids" not in batch:
            raise ValueError("Ulysses SP requires `position_ids` in every dataloader batch so that each token keeps "
                             "its global position after sequence sharding: add them in the collator "
                             "(torch.arange(seq_len) per sample; reset at document boundaries when packing)")
        length = batch["input_ids"].shape[1]
        lengths = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.sp_world_size)]
        comm.all_gather(lengths, torch.tensor([length], dtype=torch.int64, device=self.device), group=self.sp_group)
        lengths = [int(n.item()) for n in lengths]
        per_rank: dict[int, dict] = defaultdict(dict)
        for key, value in batch.items():
            if torch.is_tensor(value):
                value = value.to(self.device)
                if value.shape[1] != length:
                    raise ValueError(f"{key}'s shape {tuple(value.shape)} must match input_ids's shape "
                                     f"{tuple(batch['input_ids'].shape)}")
                gathered = [torch.zeros((value.shape[0], n, *value.shape[2:]), dtype=value.dtype, device=value.device)
                            for n in lengths]
                with torch.no_grad():
                    comm.all_gather(gathered, value.contiguous(), group=self.sp_group)
            else:
                gathered = [None] * self.sp_world_size
                comm.all_gather_object(gathered, value, group=self.sp_group)
            for rank, item in enumerate(gathered):
                per_rank[rank][key] = item
        for sample in per_rank.values():
            seq = sample["input_ids"].shape[1]
            if seq % self.sp_world_size:
                raise ValueError(f"batch's seqlen={seq} isn't divisible by sp-size={self.sp_world_size}")
            chunk = seq // self.sp_world_size
            labels = sample.pop("labels")
            sample["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
            for key, value in sample.items():
                if torch.is_tensor(value):  # kept in host memory until used: long sequences fill the device
                    sample[key] = value[:, chunk * self.sp_rank:chunk * (self.sp_rank + 1)].cpu()
            self.micro_batches.append(sample)
