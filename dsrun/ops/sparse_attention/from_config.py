"""The DeepSpeed config's ``sparse_attention`` section as a :class:`SparsityConfig`.

DeepSpeed's own engine only parses the section; a model reads it and builds its layout (DeepSpeed's BERT
example does this by ``mode``). :func:`sparsity_config_from_dict` is that step: missing keys take the
section's defaults (those of ``dsrun.config``'s schema, which differ from some class defaults: BigBird's
``num_random_blocks`` is 0 here, 1 in the class), and each mode passes only the keys it reads.
"""
from __future__ import annotations

from typing import Any, Mapping

from dsrun.ops.sparse_attention.sparsity_config import (BigBirdSparsityConfig, BSLongformerSparsityConfig,
                                                        DenseSparsityConfig, FixedSparsityConfig, SparsityConfig,
                                                        VariableSparsityConfig)
from dsrun.utils.errors import ConfigError, Problem
from dsrun.utils.suggest import did_you_mean

MODE_CLASSES: dict[str, type[SparsityConfig]] = {
    "dense": DenseSparsityConfig,
    "fixed": FixedSparsityConfig,
    "bigbird": BigBirdSparsityConfig,
    "bslongformer": BSLongformerSparsityConfig,
    "variable": VariableSparsityConfig,
}

# Which keys each mode reads, beyond block and different_layout_per_head (DeepSpeed's get_sparse_*_config).
MODE_KEYS: dict[str, tuple[str, ...]] = {
    "dense": (),
    "fixed": ("num_local_blocks", "num_global_blocks", "attention", "horizontal_global_attention",
              "num_different_global_patterns"),
    "bigbird": ("num_random_blocks", "num_sliding_window_blocks", "num_global_blocks"),
    "bslongformer": ("num_sliding_window_blocks", "global_block_indices", "global_block_end_indices"),
    "variable": ("num_random_blocks", "local_window_blocks", "global_block_indices", "global_block_end_indices",
                 "attention", "horizontal_global_attention"),
}

SECTION_DEFAULTS: dict[str, Any] = {
    "mode": "fixed", "block": 16, "different_layout_per_head": False, "num_local_blocks": 4,
    "num_global_blocks": 1, "attention": "bidirectional", "horizontal_global_attention": False,
    "num_different_global_patterns": 1, "num_random_blocks": 0, "local_window_blocks": [4],
    "global_block_indices": [0], "global_block_end_indices": None, "num_sliding_window_blocks": 3,
}


def sparsity_config_from_dict(section: Mapping[str, Any] | None, num_heads: int,
                              path: str = "sparse_attention") -> SparsityConfig:
    """The layout class and arguments that ``section`` (a ``sparse_attention`` mapping) describes.

    ``path`` names the section in error messages (``ds.sparse_attention`` in a run).
    """
    section = dict(section or {})
    unknown = [key for key in section if key not in SECTION_DEFAULTS]
    if unknown:
        raise ConfigError([Problem(f"{path}.{key}", "unknown key", did_you_mean(key, list(SECTION_DEFAULTS)))
                           for key in unknown])
    values = {**SECTION_DEFAULTS, **section}
    mode = values["mode"]
    if mode not in MODE_CLASSES:
        raise ConfigError(Problem(f"{path}.mode", f"got {mode!r}; allowed: " + ", ".join(MODE_CLASSES),
                                  did_you_mean(str(mode), list(MODE_CLASSES))))
    keys = ("block", "different_layout_per_head") + MODE_KEYS[mode]
    try:
        return MODE_CLASSES[mode](num_heads=num_heads, **{key: values[key] for key in keys})
    except (ValueError, NotImplementedError) as error:
        raise ConfigError(Problem(path, str(error))) from error
