"""dsrun's opt-in ``deepspeed`` alias (not Microsoft DeepSpeed).

This package is on the import path only when asked for (``dsrun launch --as-deepspeed``,
``dsrun.alias.install()``, or ``dsrun alias``'s ``.pth`` file). It reports the DeepSpeed version whose API
dsrun implements and serves every ``deepspeed.X`` name from dsrun; see docs/deepspeed-alias.md.
"""
from dsrun.alias import activate_in_shim as _activate

__version__ = _activate(__path__)
__version_info__ = tuple(int(part) for part in __version__.split("."))
__version_major__, __version_minor__, __version_patch__ = __version_info__
__git_hash__ = None
__git_branch__ = None


def __getattr__(name):
    import importlib

    import dsrun

    try:
        value = getattr(dsrun, name)
    except AttributeError:
        if name.startswith("__"):
            raise
        try:  # a submodule: DeepSpeed imports its subpackages eagerly, so deepspeed.runtime.X works after import
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module 'deepspeed' (dsrun's alias) has no attribute '{name}'") from None
    globals()[name] = value
    return value


def __dir__():
    import dsrun

    return sorted(set(globals()) | set(dir(dsrun)))


from dsrun.alias.finder import import_eager as _import_eager  # noqa: E402

_import_eager()
