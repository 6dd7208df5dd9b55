"""DeepSpeed's CUDA build plan on dsrun's op_builder (``CUDAOpBuilder``, ``EvoformerAttnBuilder``): the targets
each op keeps and their ``-gencode`` flags, and where the Evoformer builder finds CUTLASS's headers. Nothing is
compiled: dsrun builds CPU ops only, and says so."""
from __future__ import annotations

from pathlib import Path

import pytest

from op_builder import CUDAOpBuilder, EvoformerAttnBuilder, FPQuantizerBuilder, GDSBuilder, OpBuildError


def _cutlass(root: Path) -> Path:
    (root / "include" / "cutlass").mkdir(parents=True)
    (root / "include" / "cutlass" / "cutlass.h").write_text("// marker\n")
    (root / "tools" / "util" / "include").mkdir(parents=True)
    return root


@pytest.fixture
def bare_env(monkeypatch):
    for name in ("CUTLASS_PATH", "CUTLASS_ROOT", "CUTLASS_HOME", "CONDA_PREFIX", "VIRTUAL_ENV", "CMAKE_PREFIX_PATH",
                 "CUDA_HOME", "CUDA_PATH", "CPATH", "CPLUS_INCLUDE_PATH", "C_INCLUDE_PATH", "DS_EVOFORMER_GPU_ARCH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(EvoformerAttnBuilder, "_python_package_cutlass_paths", staticmethod(lambda: []))
    return monkeypatch


def test_gencode_flags_keep_the_targets_each_op_can_run_on(bare_env, capsys):
    bare_env.setenv("TORCH_CUDA_ARCH_LIST", "6.0 8.0;8.0+PTX;9.0")
    generic = CUDAOpBuilder("any")
    assert generic.compute_capability_args() == [
        "-gencode=arch=compute_60,code=sm_60", "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_80,code=compute_80", "-gencode=arch=compute_90,code=sm_90"]
    assert not generic.enable_bf16  # a target of major 7 or below
    evoformer = EvoformerAttnBuilder()
    assert evoformer.compute_capability_args() == [
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_80,code=compute_80",
        "-gencode=arch=compute_90,code=sm_90"]
    assert evoformer.enable_bf16 and "excluding targets below SM 7.0: [['6', '0']]" in capsys.readouterr().err
    bare_env.setenv("TORCH_CUDA_ARCH_LIST", "7.5;8.6")
    assert FPQuantizerBuilder().compute_capability_args() == ["-gencode=arch=compute_86,code=sm_86"]  # 8.0 and up
    assert "Filtered compute capabilities [['7', '5']]" in capsys.readouterr().err
    bare_env.setenv("TORCH_CUDA_ARCH_LIST", "6.1")
    with pytest.raises(RuntimeError, match="no compute capabilities remaining"):
        evoformer.compute_capability_args()
    bare_env.setenv("DS_EVOFORMER_GPU_ARCH", "80")
    evoformer.nvcc_args()
    assert "DS_EVOFORMER_GPU_ARCH is deprecated and ignored" in capsys.readouterr().err
    assert not evoformer.is_compatible()[0] and not GDSBuilder().is_compatible()[0]
    with pytest.raises(OpBuildError, match="'evoformer_attn' is a DeepSpeed CUDA kernel dsrun does not build"):
        evoformer.load()


def test_cutlass_headers_are_found_from_each_kind_of_location(bare_env, tmp_path):
    checkout = _cutlass(tmp_path / "cutlass")
    expected = [str(checkout / "include"), str(checkout / "tools" / "util" / "include")]
    for value in (checkout, checkout / "include"):  # a checkout, or its include folder
        bare_env.setenv("CUTLASS_PATH", str(value))
        assert EvoformerAttnBuilder().include_paths() == expected
    bare_env.delenv("CUTLASS_PATH")
    bare_env.setenv("CMAKE_PREFIX_PATH", f"{tmp_path / 'nothing'}:{checkout}")
    assert EvoformerAttnBuilder().include_paths() == expected
    bare_env.delenv("CMAKE_PREFIX_PATH")
    bare_env.setenv("CPATH", str(checkout / "include"))
    assert EvoformerAttnBuilder().include_paths()[0] == str(checkout / "include")
    bare_env.setenv("CUTLASS_PATH", "DS_IGNORE_CUTLASS_DETECTION")
    assert EvoformerAttnBuilder().include_paths() == []
    bare_env.setenv("CUTLASS_PATH", str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match="does not contain CUTLASS headers"):
        EvoformerAttnBuilder().include_paths()
    bare_env.delenv("CUTLASS_PATH")
    builder = EvoformerAttnBuilder()
    bare_env.setattr(builder, "_candidate_cutlass_paths", lambda: [tmp_path / "missing"])
    with pytest.raises(RuntimeError, match="Unable to locate CUTLASS"):
        builder.include_paths()
