"""``deepspeed.git_version_info``: the version and the ops this build offers (DeepSpeed's build-info module).

``version`` is the DeepSpeed API version dsrun implements (the alias's; ``dsrun.__version__`` is dsrun's own);
``installed_ops`` says which compiled ops are prebuilt and ``compatible_ops`` which can be built here.
"""
from __future__ import annotations

from dsrun.alias import DEEPSPEED_API_VERSION

version = DEEPSPEED_API_VERSION
git_hash = None
git_branch = None


def _ops() -> tuple[dict[str, bool], dict[str, bool]]:
    from op_builder import ALL_OPS

    installed, compatible = {}, {}
    for name, builder_class in ALL_OPS.items():
        builder = builder_class()
        installed[name] = builder.prebuilt_available()
        compatible[name] = builder.is_compatible()[0]
    return installed, compatible


installed_ops, compatible_ops = _ops()
