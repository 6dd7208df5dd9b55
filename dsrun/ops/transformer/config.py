"""``DeepSpeedTransformerConfig``: the settings of :class:`~dsrun.ops.transformer.DeepSpeedTransformerLayer`,
with DeepSpeed's arguments and defaults (``-1`` means "not set").

What each setting does in dsrun's layer (docs/transformer_kernel.md has the measured effects):

* ``batch_size``, ``max_seq_length``: the largest input accepted (checked on every call when set).
* ``hidden_size``, ``intermediate_size`` (default ``4 * hidden_size``), ``heads``: the shapes.
* ``attn_dropout_ratio``, ``hidden_dropout_ratio``: dropout on the attention probabilities and on the two
  residual branches (unset means 0).
* ``num_hidden_layers``, ``initializer_range``, ``adjust_init_range``: initialisation, N(0, range), the two
  output projections scaled by ``1/sqrt(2 * num_hidden_layers)`` when ``adjust_init_range``.
* ``layer_norm_eps``; ``pre_layer_norm``: Pre-LN (``x + f(LN(x))``) or Post-LN (``LN(x + f(x))``).
* ``seed``: dropout masks come from a generator seeded with it (shared by the layers with that seed, as
  DeepSpeed's kernels share one), so they do not depend on torch's global RNG; unset uses torch's.
* ``fp16``: compute in float16 (inputs and weights cast, output float16).
* ``local_rank``: the accelerator device to select (a no-op on CPU).
* Memory flags (fewer saved activations, same gradients): ``normalize_invertible`` (LayerNorm keeps its
  output, not its input), ``attn_dropout_checkpoint`` (the dropped-out attention probabilities are
  recomputed), ``gelu_checkpoint`` (the GELU output is recomputed).
* ``stochastic_mode``: attention, dropout included, runs in torch's fused ``scaled_dot_product_attention``
  with its own dropout RNG: faster on GPUs, but the masks differ from the deterministic path's.
* ``return_tuple``: ``forward`` returns ``(output,)``; ``training``: the layer starts in training mode.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class TransformerConfig:
    """The shape and dropout part of the configuration (DeepSpeed's base class)."""

    def __init__(self, batch_size: int, hidden_size: int, intermediate_size: int, heads: int,
                 attn_dropout_ratio: float, hidden_dropout_ratio: float, num_hidden_layers: int,
                 initializer_range: float):
        self.layer_id = -1
        self.batch_size = batch_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.heads = heads
        self.attn_dropout_ratio = attn_dropout_ratio
        self.hidden_dropout_ratio = hidden_dropout_ratio
        self.num_hidden_layers = num_hidden_layers
        self.initializer_range = initializer_range


class DeepSpeedTransformerConfig(TransformerConfig):
    """Configuration of a BERT-style transformer layer; see the module docstring for each argument."""

    def __init__(self, batch_size: int = -1, hidden_size: int = -1, intermediate_size: int = -1, heads: int = -1,
                 attn_dropout_ratio: float = -1, hidden_dropout_ratio: float = -1, num_hidden_layers: int = -1,
                 initializer_range: float = -1, layer_norm_eps: float = 1e-12, local_rank: int = -1,
                 seed: int = -1, fp16: bool = False, pre_layer_norm: bool = True, normalize_invertible: bool = False,
                 gelu_checkpoint: bool = False, adjust_init_range: bool = True, attn_dropout_checkpoint: bool = False,
                 stochastic_mode: bool = False, return_tuple: bool = False, training: bool = True,
                 max_seq_length: int = -1):
        super().__init__(batch_size, hidden_size, intermediate_size if intermediate_size > 0 else 4 * hidden_size,
                         heads, attn_dropout_ratio, hidden_dropout_ratio, num_hidden_layers, initializer_range)
        self.max_seq_length = max_seq_length
        self.layer_norm_eps = layer_norm_eps
        self.local_rank = local_rank
        self.seed = seed
        self.fp16 = fp16
        self.pre_layer_norm = pre_layer_norm
        self.normalize_invertible = normalize_invertible
        self.gelu_checkpoint = gelu_checkpoint
        self.adjust_init_range = adjust_init_range
        self.attn_dropout_checkpoint = attn_dropout_checkpoint
        self.stochastic_mode = stochastic_mode
        self.return_tuple = return_tuple
        self.training = training

    @classmethod
    def from_dict(cls, json_object: dict[str, Any]) -> "DeepSpeedTransformerConfig":
        """A config with the defaults overridden by ``json_object``'s keys (unknown keys are refused)."""
        config = cls()
        unknown = sorted(key for key in json_object if not hasattr(config, key))
        if unknown:
            raise ValueError(f"unknown DeepSpeedTransformerConfig keys: {', '.join(unknown)}")
        config.__dict__.update(json_object)
        if "intermediate_size" not in json_object or json_object["intermediate_size"] <= 0:
            config.intermediate_size = 4 * config.hidden_size
        return config

    @classmethod
    def from_json_file(cls, json_file: str | Path) -> "DeepSpeedTransformerConfig":
        """Read a JSON file (UTF-8, or UTF-16 with a byte-order mark as DeepSpeed writes them)."""
        raw = Path(json_file).read_bytes()
        text = raw.decode("utf-16") if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else raw.decode("utf-8-sig")
        return cls.from_dict(json.loads(text))

    def check(self) -> None:
        """Raise ``ValueError`` naming the first setting a layer cannot be built from."""
        if self.hidden_size <= 0 or self.heads <= 0:
            raise ValueError(f"hidden_size ({self.hidden_size}) and heads ({self.heads}) must be set (positive)")
        if self.hidden_size % self.heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) is not a multiple of heads ({self.heads})")
        for name in ("attn_dropout_ratio", "hidden_dropout_ratio"):
            if getattr(self, name) >= 1:
                raise ValueError(f"{name} must be below 1, got {getattr(self, name)}")
        if self.initializer_range <= 0 and self.initializer_range != -1:
            raise ValueError(f"initializer_range must be positive, got {self.initializer_range}")
