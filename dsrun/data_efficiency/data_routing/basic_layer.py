"""``RandomLayerTokenDrop``: a transformer layer that, while training, runs on a random subset of the tokens.

DeepSpeed's ``deepspeed.runtime.data_pipeline.data_routing.basic_layer.RandomLayerTokenDrop`` (Yao et al.,
"Random-LTD: Random and Layerwise Token Dropping Brings Efficient Training for Large-scale Transformers").
Each forward keeps ``scheduler.get_current_seq()`` tokens chosen uniformly at random (independently per
sample and per layer, in their original order), runs the wrapped layer on them, and writes the results back
over the full sequence; the dropped tokens pass through unchanged, so the next layer sees every token again.
In eval mode, or when the kept length reaches the sequence length, the layer runs on everything.

The wrapped layer is ``self.random_ltd_layer`` (so its parameters are named ``<layer>.random_ltd_layer.*``;
:func:`~dsrun.data_efficiency.data_routing.helper.remove_random_ltd_state_dict` strips that part). Its
forward must take the hidden states first and everything else by keyword; the attention mask, when the model
has one, is the keyword ``model_mask_name`` and is cut to the kept tokens.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dsrun.ops.random_ltd.dropping_utils import GatherTokens, ScatterTokens, bert_sample_tokens, gpt_sample_tokens
from dsrun.utils.errors import ConfigError, Problem

if TYPE_CHECKING:
    from dsrun.config.data_efficiency import RandomLTDConfig

    from .scheduler import RandomLTDScheduler


class RandomLayerTokenDrop(nn.Module):
    """Wraps ``layer``; inert until :meth:`init_config` gives it the schedule (``engine.random_ltd_initialize``)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.random_ltd_layer = layer
        self.random_ltd_scheduler: RandomLTDScheduler | None = None
        self.random_ltd_layer_id = -1
        self.reserved_length = -1
        self.curr_seq = -1
        self.curr_micro_batch = -1
        self.batch_first = True
        self.mask_name: str | None = None
        self.model_type = "decoder"

    def init_config(self, config: dict[str, Any] | RandomLTDConfig, scheduler: RandomLTDScheduler,
                    random_ltd_layer_id: int) -> None:
        """Attach the ``random_ltd`` section (dict or typed) and its scheduler; ``random_ltd_layer_id`` is this
        layer's position among the random-LTD layers."""
        get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
        order = get("hidden_state_order") or "batch_seq_dim"
        self.model_type = get("model_type") or "decoder"
        if order not in ("batch_seq_dim", "seq_batch_dim") or self.model_type not in ("decoder", "encoder"):
            raise ConfigError(Problem("data_efficiency.data_routing.random_ltd",
                                      f"hidden_state_order {order!r} / model_type {self.model_type!r}: allowed "
                                      "batch_seq_dim | seq_batch_dim and decoder | encoder"))
        self.batch_first = order == "batch_seq_dim"
        self.mask_name = get("model_mask_name")
        self.random_ltd_scheduler = scheduler
        self.random_ltd_layer_id = int(random_ltd_layer_id)

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> Any:
        if self.random_ltd_scheduler is None or not self.training:
            return self.random_ltd_layer(hidden_states, **kwargs)
        self.reserved_length = int(self.random_ltd_scheduler.get_current_seq())
        seq_dim, batch_dim = (1, 0) if self.batch_first else (0, 1)
        self.curr_seq, self.curr_micro_batch = hidden_states.size(seq_dim), hidden_states.size(batch_dim)
        if self.reserved_length >= self.curr_seq:
            return self.random_ltd_layer(hidden_states, **kwargs)
        mask = kwargs.get(self.mask_name) if self.mask_name is not None else None
        sampler = bert_sample_tokens if self.model_type == "encoder" else gpt_sample_tokens
        indices, part_mask = sampler(self.reserved_length, self.curr_seq, self.curr_micro_batch, 1,
                                     hidden_states.device, mask)
        indices = indices[0]
        if self.mask_name is not None and mask is not None:
            kwargs[self.mask_name] = part_mask[0] if self.model_type == "encoder" else part_mask
        hidden_states, kept = GatherTokens.apply(hidden_states, indices, self.batch_first)
        outputs = self.random_ltd_layer(kept, **kwargs)
        if isinstance(outputs, tuple):
            return (ScatterTokens.apply(hidden_states, outputs[0], indices, self.batch_first), *outputs[1:])
        if isinstance(outputs, torch.Tensor):
            return ScatterTokens.apply(hidden_states, outputs, indices, self.batch_first)
        raise TypeError(f"random-LTD supports layers returning a tensor or a tuple, got {type(outputs).__name__}")

    def extra_repr(self) -> str:
        return f"layer_id={self.random_ltd_layer_id}, kept={self.reserved_length}"
