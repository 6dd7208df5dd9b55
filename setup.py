"""Packaging hooks that pyproject.toml cannot express.

0. conf/ and recipes/ are plain folders at the top of the repository; they ship inside the wheel as the data
   packages ``dsrun._conf`` and ``dsrun._recipes`` (mapped in pyproject.toml), which a package scan cannot
   find by itself, so the package list is written here.
1. The C++ sources in ``csrc/`` ship inside the wheel as ``op_builder/_csrc`` so that ops can be JIT-built
   after a regular (non-editable) install.
2. ``DSRUN_BUILD_OPS=1 pip install --no-build-isolation .`` compiles every op ahead of time into
   ``op_builder._prebuilt`` (torch must be importable while building, hence --no-build-isolation: an
   isolated build would have to download torch).
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from setuptools import find_namespace_packages, find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
CSRC_SUFFIXES = {".cpp", ".h", ".hpp", ".cc"}


class BuildPyWithCsrc(build_py):
    """build_py that also copies csrc/ into the package as op_builder/_csrc."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "op_builder" / "_csrc"
        for source in (HERE / "csrc").rglob("*"):
            if source.is_file() and source.suffix in CSRC_SUFFIXES:
                destination = target / source.relative_to(HERE / "csrc")
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, destination)


def ahead_of_time_ops() -> tuple[list, dict]:
    if os.environ.get("DSRUN_BUILD_OPS") != "1":
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        sys.exit("DSRUN_BUILD_OPS=1 needs torch importable while building: "
                 "pip install --no-build-isolation . (with torch installed first)")
    sys.path.insert(0, str(HERE))
    from op_builder import ALL_OPS

    extensions = []
    for name, builder_class in ALL_OPS.items():
        builder = builder_class()
        extensions.append(CppExtension(
            name=f"op_builder._prebuilt.{name}",
            sources=[os.path.relpath(s, HERE) for s in builder.sources()],
            include_dirs=[str(d) for d in builder.include_dirs()],
            extra_compile_args=builder.cxx_flags(),
            extra_link_args=builder.ld_flags(),
        ))
    return extensions, {"build_ext": BuildExtension}


ext_modules, ext_commands = ahead_of_time_ops()
# hydra_plugins/ is Hydra's namespace package for plugins (dsrun's Optuna sweeper); it has no __init__.py
setup(packages=find_packages(include=["dsrun", "dsrun.*", "op_builder", "op_builder.*"])
      + find_namespace_packages(include=["hydra_plugins.*"]) + ["dsrun._conf", "dsrun._recipes"],
      cmdclass={"build_py": BuildPyWithCsrc, **ext_commands}, ext_modules=ext_modules)
