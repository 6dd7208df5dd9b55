"""DeepSpeed's ``AutoTP`` class (``deepspeed.module_inject.auto_tp.AutoTP``): the object DeepSpeed's engine and
tests drive to split a model by hand, on dsrun's split.

    autotp = AutoTP(module=model, all_reduce_linears=[], prefix="", state_dict=None, linear_layer_setting=None,
                    orig_layer_impl=None, keep_module_on_host=False, partition_config=AutoTPConfig.from_dict(...))
    autotp.set_tensor_parallel_config(tp_size, tp_group)
    autotp.update_linear_policies()
    autotp._replace_module(model)

``_replace_module`` splits the model over the group: by ``partition_config``'s rules when it was given
(:func:`dsrun.tensor_parallel.spec_split.split_by_specs`: DeepSpeed's ``LinearLayer``/``LinearAllreduce`` and,
for a ``shape``, its ``SubParamLinearLayer``/``SubParamLinearAllreduce``) over the layers DeepSpeed's walk hands
to ``_replace_with_config`` under their full names, else by dsrun's reading of the module tree
(:func:`dsrun.tensor_parallel.split.split_for_training`); the split layout is kept as ``autotp.layout``.
``update_mp_params(child, name)`` is DeepSpeed's rewrite of a module's head counts and widths to this rank's share
(each by DeepSpeed's shard sizes under the module's name, so an MLP's attributes follow its weights' even cut and an
attention's the key/value groups'); ``get_model_num_kv_heads(config)`` reads the key/value head count as DeepSpeed
does. ``_slice_embedding(child, name, conv_linear_layer)`` is DeepSpeed's cut of an embedding's hidden columns
(:func:`dsrun.tensor_parallel.spec_split.slice_embedding`, with its row-partition metadata; ``_replace_module`` with a
``partition_config`` applies it to the embeddings a rule names; dsrun's vocabulary cut for training is
``tensor_parallel.vocab_parallel_lm_head``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from dsrun import comm

from . import shard_sizes
from .autotp_config import AutoTPConfig
from .split import TPLayout, model_num_kv_heads, set_keep_module_on_host, split_for_training

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# the attributes DeepSpeed's update_mp_params rewrites to this rank's share
_MP_PARAMS = ("n_heads", "inner_dim", "num_heads", "num_kv", "num_attention_heads", "num_attn_heads", "all_head_size",
              "embed_dim", "hidden_size", "num_key_value_heads", "num_kv_heads", "kv_n_heads", "d_model",
              "num_attention_heads_per_partition", "num_multi_query_groups_per_partition",
              "hidden_size_per_partition")


class AutoTP:
    """DeepSpeed's AutoTP driver object (its constructor's arguments; ``state_dict`` and ``orig_layer_impl`` are
    DeepSpeed-Inference's checkpoint loading and policy, which the training split does not read)."""

    def __init__(self, module: nn.Module, all_reduce_linears: object, prefix: str, state_dict: object,
                 linear_layer_setting: Sequence[type] | None, orig_layer_impl: type | None, keep_module_on_host: bool = False,
                 partition_config: AutoTPConfig | None = None):
        self.module, self.all_reduce_linears, self.prefix, self.state_dict = module, all_reduce_linears, prefix, state_dict
        self.linear_layer_setting, self.orig_layer_impl = linear_layer_setting, orig_layer_impl
        self.keep_module_on_host, self.partition_config = keep_module_on_host, partition_config
        set_keep_module_on_host(keep_module_on_host)  # process-wide, as DeepSpeed's AutoTP sets its layers' flag
        self.mp_size: int | None = None
        self.mp_group: ProcessGroup | None = None
        self.linear_policies: dict[type, Any] | None = None
        self.conv_linear_layer = False
        self.layout: TPLayout | None = None

    @staticmethod
    def get_model_num_kv_heads(config: object) -> int | None:
        """The key/value head count of a model config, as DeepSpeed reads it."""
        holder = nn.Module()
        holder.config = config
        return model_num_kv_heads(holder)

    def set_tensor_parallel_config(self, mp_size: int, mp_group: ProcessGroup | None) -> None:
        self.mp_size, self.mp_group = int(mp_size), mp_group

    def update_linear_policies(self) -> None:
        """Which module classes the split replaces (DeepSpeed's ``linear_policies``): ``linear_layer_setting``'s
        classes, else ``nn.Linear`` and ``nn.Embedding`` (a GPT-2 block policy: ``Conv1D``); an embedding class maps
        to :meth:`_slice_embedding`. dsrun's automatic split cuts ``nn.Linear`` and ``Conv1D`` and keeps embeddings
        whole (rules cut the embeddings they name); another linear class is refused (ValueError)."""
        self.conv_linear_layer = getattr(self.orig_layer_impl, "__name__", None) == "GPT2Block"
        classes = tuple(self.linear_layer_setting or (nn.Linear, nn.Embedding))
        for cls in classes:
            if not (isinstance(cls, type) and (issubclass(cls, (nn.Linear, nn.Embedding)) or cls.__name__ == "Conv1D")):
                raise ValueError(f"AutoTP linear_layer_setting: {cls!r} is not a linear class dsrun's split cuts "
                                 "(nn.Linear, transformers' Conv1D; nn.Embedding stays whole)")
        self.linear_policies = {cls: (self._slice_embedding if issubclass(cls, nn.Embedding) else "linear")
                                for cls in classes}

    def _rank(self) -> int:
        return comm.get_rank(group=self.mp_group) if self.mp_group is not None else 0

    def _slice_embedding(self, child: nn.Embedding, name: str, conv_linear_layer: bool = False) -> nn.Embedding | None:
        """This rank's slice of ``child``'s hidden columns as a new ``nn.Embedding`` (DeepSpeed's shard sizes under
        ``name``; the weight records DeepSpeed's row-partition metadata); None when ``child`` was replaced already."""
        from .spec_split import slice_embedding

        if getattr(child, "replaced", False):
            return None
        return slice_embedding(child, name, self.mp_group, self._rank(), int(self.mp_size or 1))

    def _replace_module(self, r_module: nn.Module, prev_name: str = "", prev_class_name: str = "") -> nn.Module:
        """Split ``r_module`` over the group set by :meth:`set_tensor_parallel_config` (in place); returns it.

        With ``partition_config`` this walks the tree as DeepSpeed does: each child holding a 2-D weight is handed
        to :meth:`_replace_with_config` under its full dotted name (``layers.0.self_attn.q_proj``); a module it
        returns in the child's place replaces the child. The split itself is dsrun's whole-model cut over the
        names chosen (:func:`~dsrun.tensor_parallel.spec_split.split_by_specs`: whole heads, key/value groups, a
        gathered column output tied to an embedding left whole), done once after the walk."""
        from .spec_split import split_by_specs

        if self.partition_config is not None:
            self._chosen: set[str] = set()
            self._walk(r_module, prev_name)
            if not self._chosen:  # nothing left to cut (an override of _replace_with_config replaced or kept all)
                return r_module
        if self.mp_size is None:
            raise ValueError("AutoTP._replace_module: call set_tensor_parallel_config(mp_size, mp_group) first")
        rank, grain = self._rank(), shard_sizes.tp_grain_size
        if self.partition_config is None:
            self.layout = split_for_training(r_module, self.mp_group, rank, self.mp_size, grain)
            return r_module
        self.layout = split_by_specs(r_module, self.partition_config, self.mp_group, rank, self.mp_size,
                                     "AutoTP(partition_config)", grain, only=self._chosen)
        return r_module

    def _walk(self, module: nn.Module, path: str) -> None:
        for name, child in module.named_children():
            full_name = f"{path}.{name}" if path else name
            weight = getattr(child, "weight", None)
            if isinstance(child, nn.Embedding):  # chosen when a rule names it: the split cuts it (_slice_embedding)
                if self.partition_config.find_matching_spec(f"{full_name}.weight", self._get_model_type()):
                    self._chosen.add(full_name)
            elif isinstance(weight, torch.Tensor) and weight.dim() == 2:
                new_child = self._replace_with_config(child, full_name)
                if new_child is not None and new_child is not child:
                    setattr(module, name, new_child)
            else:
                self._walk(child, full_name)

    def _replace_with_config(self, child: nn.Module, name: str) -> nn.Module:
        """DeepSpeed's per-layer step of the ``partition_config`` walk: here it chooses ``child`` (its name) for
        the one split after the walk and returns it unchanged (a subclass may return a layer of its own)."""
        self._chosen.add(name)
        return child

    def _get_model_type(self) -> str | None:
        """The model's ``config.model_type``, lower-case (what a spec's ``model_types`` names)."""
        from .spec_split import model_type_of

        return model_type_of(self.module)

    def update_mp_params(self, child: nn.Module, name: str | None = None) -> None:
        """Rewrite ``child``'s head counts and widths to this rank's share, each cut by DeepSpeed's shard sizes under
        ``name`` (once per module; a module holding 3-D expert weights keeps its attributes whole)."""
        if getattr(child, "replaced", False):
            return
        if not any(p.dim() >= 3 for p in child.parameters(recurse=False)):
            rank = comm.get_rank(group=self.mp_group) if self.mp_group is not None else 0
            for attr in _MP_PARAMS:
                if attr == "embed_dim" and "Yuan" in str(child):
                    continue
                value = getattr(child, attr, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    setattr(child, attr, shard_sizes.get_shard_size(value, self.mp_size, name, rank=rank))
        child.replaced = True
