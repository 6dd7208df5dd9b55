"""``deepspeed.git_version_info``: the version and the ops this build offers (DeepSpeed's build-info module).

``version`` is the DeepSpeed API version dsrun implements (the alias's; ``dsrun.__version__`` is dsrun's own);
``installed_ops`` says which compiled ops are prebuilt and ``compatible_ops`` which can be built here.
"""
from __future__ import annotations

from dsrun.alias import DEEPSPEED_API_VERSION
from dsrun.ops import compatible_ops as _compatible_ops

version = DEEPSPEED_API_VERSION
git_hash = None
git_branch = None


def _installed_ops() -> dict[str, bool]:
    from op_builder import ALL_OPS

    return {name: builder().prebuilt_available() for name, builder in ALL_OPS.items()}


installed_ops = _installed_ops()
compatible_ops = _compatible_ops()

#: the torch this process runs, in DeepSpeed's build-info shape ("major.minor"; "0.0" where absent)
torch_info: dict[str, object] = {}


def _torch_info() -> dict[str, object]:
    import torch

    def major_minor(text: str | None) -> str:
        return ".".join((text or "0.0").split("+")[0].split(".")[:2])

    nccl = ".".join(str(part) for part in torch.cuda.nccl.version()[:2]) if torch.cuda.is_available() else "0.0"
    return {"version": major_minor(torch.__version__), "bf16_support": True,
            "cuda_version": major_minor(torch.version.cuda), "nccl_version": nccl,
            "hip_version": major_minor(getattr(torch.version, "hip", None))}


torch_info.update(_torch_info())
