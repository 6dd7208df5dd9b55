"""DeepSpeed's ``EvoformerAttnBuilder`` (DeepSpeed4Science's Evoformer attention, a CUTLASS kernel): its build
plan as DeepSpeed computes it, which dsrun never builds (:class:`~op_builder.builder.CUDAOpBuilder`).

What it decides: targets below compute capability 7.0 are dropped (the kernel needs Tensor Cores), the retired
``DS_EVOFORMER_GPU_ARCH`` is ignored with a warning, and the CUTLASS headers are searched for, first match wins:
``CUTLASS_PATH`` (a checkout, or its ``include`` folder; ``DS_IGNORE_CUTLASS_DETECTION`` skips the search and
``DS_USE_CUTLASS_PYTHON_BINDINGS`` looks in the ``nvidia-cutlass`` package only), else the ``cutlass_library``
package, the prefixes in ``CUTLASS_ROOT``, ``CUTLASS_HOME``, ``CONDA_PREFIX``, ``VIRTUAL_ENV``,
``CMAKE_PREFIX_PATH``, ``CUDA_HOME``, ``CUDA_PATH``, Python's prefixes, the compiler's ``CPATH``,
``CPLUS_INCLUDE_PATH``, ``C_INCLUDE_PATH``, ``./cutlass``, a ``cutlass`` checkout in or beside this repository,
``/usr/local/cutlass``, ``/opt/cutlass``, ``/usr/local`` and ``/usr``. A folder matches when it holds
``include/cutlass/cutlass.h`` (a checkout or prefix) or ``cutlass/cutlass.h`` (an include folder).
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from op_builder.builder import CUDAOpBuilder


class EvoformerAttnBuilder(CUDAOpBuilder):
    BUILD_VAR = "DS_BUILD_EVOFORMER_ATTN"
    NAME = "evoformer_attn"
    CUTLASS_IGNORE = "DS_IGNORE_CUTLASS_DETECTION"
    CUTLASS_PYTHON_BINDINGS = "DS_USE_CUTLASS_PYTHON_BINDINGS"

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self.cutlass_path = os.environ.get("CUTLASS_PATH")
        self._resolved_cutlass_path: Path | None = None

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.NAME}_op"

    def nvcc_args(self) -> list[str]:
        if os.environ.get("DS_EVOFORMER_GPU_ARCH"):
            self.warning("DS_EVOFORMER_GPU_ARCH is deprecated and ignored for Evoformer builds. "
                         "Use TORCH_CUDA_ARCH_LIST to control build targets.")
        return super().nvcc_args()

    def filter_ccs(self, ccs: list[str]) -> list[list[str]]:
        """Keep the Tensor Core targets (compute capability 7.0 and above)."""
        split = [cc.split(".") for cc in ccs]
        pruned = [cc for cc in split if int(cc[0]) < 7]
        if pruned:
            self.warning(f"Evoformer: excluding targets below SM 7.0: {pruned}. Tensor Core required.")
        return [cc for cc in split if int(cc[0]) >= 7]

    # ------------------------------------------------------------------ where CUTLASS is
    @staticmethod
    def _python_package_cutlass_paths() -> list[Path]:
        """Where the ``nvidia-cutlass`` package (``cutlass_library``) keeps the headers, if it is installed."""
        try:
            package = importlib.import_module("cutlass_library")
        except ImportError:
            return []
        found = [Path(package.source_path)] if getattr(package, "source_path", None) is not None else []
        if getattr(package, "__file__", None) is not None:
            folder = Path(package.__file__).resolve().parent
            found += [folder / "source", folder.parent, folder]
        return found

    @staticmethod
    def _env_paths(*names: str) -> list[Path]:
        return [Path(part) for name in names for part in os.environ.get(name, "").split(os.pathsep) if part]

    def _candidate_cutlass_paths(self) -> list[Path]:
        if self.cutlass_path == self.CUTLASS_PYTHON_BINDINGS:
            found = self._python_package_cutlass_paths()
            if not found:
                self.warning("Please pip install nvidia-cutlass")
                raise ImportError("Unable to locate CUTLASS from the nvidia-cutlass Python package")
            return found
        if self.cutlass_path:
            return [Path(self.cutlass_path)]
        repo_root = Path(__file__).resolve().parents[1]
        candidates = [
            *self._python_package_cutlass_paths(),
            *self._env_paths("CUTLASS_ROOT", "CUTLASS_HOME", "CONDA_PREFIX", "VIRTUAL_ENV", "CMAKE_PREFIX_PATH",
                             "CUDA_HOME", "CUDA_PATH"),
            Path(sys.prefix), Path(sys.exec_prefix), Path(sys.base_prefix),
            *self._env_paths("CPATH", "CPLUS_INCLUDE_PATH", "C_INCLUDE_PATH"),
            Path.cwd() / "cutlass", repo_root / "cutlass", repo_root.parent / "cutlass",
            Path("/usr/local/cutlass"), Path("/opt/cutlass"), Path("/usr/local"), Path("/usr"),
        ]
        return list(dict.fromkeys(path.expanduser() for path in candidates))  # first occurrence of each

    @staticmethod
    def _cutlass_include_dirs(path: Path) -> list[str]:
        """The include folders a CUTLASS location gives (its headers, and its tools' headers where present)."""
        path = path.expanduser().resolve()
        if (path / "include" / "cutlass" / "cutlass.h").is_file():
            root, util = path / "include", path / "tools" / "util" / "include"
        elif (path / "cutlass" / "cutlass.h").is_file():
            root, util = path, path.parent / "tools" / "util" / "include"
        else:
            return []
        return [str(root)] + ([str(util)] if util.is_dir() else [])

    def include_paths(self) -> list[str]:
        if self.cutlass_path == self.CUTLASS_IGNORE:  # the user has set the compiler's paths up already
            return []
        for path in self._candidate_cutlass_paths():
            found = self._cutlass_include_dirs(path)
            if found:
                self._resolved_cutlass_path = path.expanduser().resolve()
                return found
        if self.cutlass_path:
            raise RuntimeError(f"CUTLASS_PATH {self.cutlass_path} does not contain CUTLASS headers")
        raise RuntimeError("Unable to locate CUTLASS. Install nvidia-cutlass, clone CUTLASS next to DeepSpeed, "
                           "or set CUTLASS_PATH to the CUTLASS checkout.")
