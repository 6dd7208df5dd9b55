"""Serve ``deepspeed.X.Y`` imports with dsrun's modules.

Which dsrun module serves a DeepSpeed path is :data:`dsrun.alias.paths.PATHS`'s to say (the one table; a path
it does not name is the same path under dsrun). The module object is dsrun's own, not a copy:
``deepspeed.comm is dsrun.comm``, so state set through one name is seen through the other.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

from dsrun.alias.paths import ALIAS, children_elsewhere, target_of

# The submodules ``import deepspeed`` imports in DeepSpeed (its ``__init__``'s imports, then the imports of the
# ``__init__`` of each package among them), so that after ``import deepspeed`` each is an attribute of its parent
# (``deepspeed.runtime.pipe.engine``, ``deepspeed.runtime.zero.partition_parameters``) as in DeepSpeed. Those dsrun
# does not serve are skipped (docs/deepspeed-alias.md lists them), as are their children.
EAGER: tuple[str, ...] = (
    # deepspeed/__init__.py
    "ops", "module_inject", "accelerator", "constants", "runtime.engine", "runtime.base_optimizer",
    "runtime.dataloader", "runtime.hybrid_engine", "runtime.pipe.engine", "inference.engine", "inference.config",
    "runtime.lr_schedules", "runtime.config", "runtime.activation_checkpointing.checkpointing", "ops.transformer",
    "utils", "comm.comm", "runtime.zero", "runtime.domino", "runtime.compiler", "pipe", "git_version_info",
    "runtime.tensor_parallel", "runtime.tensor_parallel.init_utils",
    # runtime.engine's own helpers, which scripts reach through the attribute (issue 43)
    "runtime.utils",
    # ops/__init__.py, runtime/zero/__init__.py, runtime/pipe/__init__.py, utils/__init__.py, comm/__init__.py
    "ops.adam", "ops.adagrad", "ops.lamb", "ops.lion", "ops.sparse_attention", "ops.fp_quantizer",
    "runtime.zero.partition_parameters", "runtime.zero.parameter_offload", "runtime.zero.tiling",
    "runtime.zero.mics", "runtime.zero.stage3", "runtime.pipe.module", "runtime.pipe.topology", "utils.logging",
    "utils.comms_logging", "utils.init_on_device", "utils.groups", "utils.nvtx", "utils.tensor_fragment",
    "utils.z3_leaf_module", "utils.mixed_precision_linkage", "utils.numa", "comm.utils",
    # dsrun's own: deepspeed.zero, deepspeed.checkpointing and deepspeed.monitor are dsrun's public names too
    "zero", "checkpointing", "monitor", "runtime.activation_checkpointing.checkpoint",
)

# Submodules whose package ``__init__`` then imports a function of the same name from them
# (deepspeed/utils/__init__.py: ``from .z3_leaf_module import z3_leaf_module``): in DeepSpeed, after
# ``import deepspeed`` the package attribute is that function, while the import path still gives the module.
SHADOWED_BY_FUNCTION: tuple[str, ...] = ("utils.z3_leaf_module",)


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # a placeholder; exec_module swaps in the dsrun module

    def exec_module(self, module: ModuleType) -> None:
        # The import system returns whatever sits in sys.modules under the name once exec_module is done.
        target = importlib.import_module(self.target)
        sys.modules[module.__name__] = target
        # `from deepspeed.launcher import runner` looks the child up on dsrun.launcher (by the module's own
        # name), so a child the table serves from elsewhere is imported and set there as the parent is loaded;
        # a compat package finds its children itself (its ``__getattr__``), on first use
        if "__getattr__" in vars(target):
            return
        for source in children_elsewhere(module.__name__):
            setattr(target, source.rpartition(".")[2], importlib.import_module(source))


class AliasFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder for the submodules of ``deepspeed``; the package itself is the shim on the alias path."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: D401 - importlib's signature
        if fullname == ALIAS:
            return None  # the shim package (site/deepspeed) is found on sys.path like any package
        dsrun_name = target_of(fullname)
        if dsrun_name is None:
            return None
        try:
            dsrun_spec = importlib.util.find_spec(dsrun_name)
        except ModuleNotFoundError:
            dsrun_spec = None
        if dsrun_spec is None:
            return None  # the import fails with DeepSpeed's own name in the message
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(dsrun_name),
                                              is_package=dsrun_spec.submodule_search_locations is not None)


def activate() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, AliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder())


def _served(name: str) -> bool:
    """Whether dsrun serves ``deepspeed.<name>`` (without importing it: only its parents, to find it)."""
    target = target_of(f"{ALIAS}.{name}")
    try:
        return target is not None and importlib.util.find_spec(target) is not None
    except ModuleNotFoundError:  # a parent package dsrun does not have
        return False


def import_eager() -> None:
    """Import :data:`EAGER` under their ``deepspeed.`` names (after the shim package is in sys.modules); importing
    a module sets it as an attribute of its parent. A path dsrun does not serve is skipped. Then each of
    :data:`SHADOWED_BY_FUNCTION` gives its parent the function it is named after, as DeepSpeed's ``__init__`` does."""
    for name in EAGER:
        if _served(name):
            importlib.import_module(f"{ALIAS}.{name}")
    for name in SHADOWED_BY_FUNCTION:
        if _served(name):
            module = importlib.import_module(f"{ALIAS}.{name}")
            parent, _, child = f"{ALIAS}.{name}".rpartition(".")
            setattr(sys.modules[parent], child, getattr(module, child))
