"""Load a compiled op for a wrapper, or fall back to torch with one warning when no compiler exists."""
from __future__ import annotations

import warnings
from types import ModuleType

from op_builder import CompilerUnavailableError, get_builder

_loaded: dict[str, ModuleType | None] = {}


class OpFallbackWarning(UserWarning):
    """A compiled op could not be built (no C++ compiler) and a slower pure-torch version is used instead."""


def load_op(name: str) -> ModuleType | None:
    """The compiled module for op ``name``, or None (after one warning per op) when no compiler is available.

    Any other build failure raises ``op_builder.OpBuildError`` with the compiler's own error text.
    """
    if name in _loaded:
        return _loaded[name]
    try:
        module: ModuleType | None = get_builder(name).load()
    except CompilerUnavailableError as err:
        warnings.warn(f"{err}. dsrun uses the pure-torch '{name}' fallback instead, which is slower.",
                      OpFallbackWarning, stacklevel=3)
        module = None
    _loaded[name] = module
    return module
