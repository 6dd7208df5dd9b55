"""Package list for setuptools (everything else is in pyproject.toml).

conf/ and recipes/ are plain folders at the top of the repository; they ship inside the wheel as the data
packages ``dsrun._conf`` and ``dsrun._recipes`` (mapped in pyproject.toml), which a package scan cannot find
by itself, so they are listed here.
"""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["dsrun", "dsrun.*", "op_builder", "op_builder.*"])
      + ["dsrun._conf", "dsrun._recipes"])
