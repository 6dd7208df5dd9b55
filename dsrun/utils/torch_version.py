"""``deepspeed.utils.torch``: ``required_torch_version``, the version gate DeepSpeed's code and tests ask
before using a newer torch feature (served at DeepSpeed's path through :mod:`dsrun.alias.paths`)."""
from __future__ import annotations

import torch
from packaging import version


def required_torch_version(min_version: float | str | None = None, max_version: float | str | None = None) -> bool:
    """Whether the installed torch lies within ``[min_version, max_version]`` (either bound may be left out,
    not both). ``2.1`` and ``"2.1"`` are the same bound; a local build tag (``2.13.0+cpu``) compares as its
    release, after the bare release, as ``packaging`` orders versions (DeepSpeed's rule)."""
    if not (min_version or max_version):
        raise ValueError("required_torch_version: give a min_version or a max_version")
    installed = version.parse(torch.__version__)
    if min_version and version.parse(str(min_version)) > installed:
        return False
    return not (max_version and version.parse(str(max_version)) < installed)


def is_functorch_transforming() -> bool:
    """True inside ``torch.func.grad`` / ``vmap`` / ``jacrev``: a functorch transform is on the interpreter
    stack (its private peek is read with ``getattr``, so a torch that moves it answers False)."""
    functorch = getattr(torch._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None
