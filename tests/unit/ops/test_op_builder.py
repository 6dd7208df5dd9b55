"""op_builder: JIT build into a fresh cache, cache hits without compiling, and clear build failures."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Sequence

import pytest

import op_builder
from op_builder import CompilerUnavailableError, OpBuildError, get_builder
from op_builder.builder import OpBuilder
from tests.helpers import REPO, require_built_op


def run_python(code: str, env: dict[str, str], timeout: float = 600,
               args: Sequence[str] = ()) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=full_env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd=REPO)


# An op of a few lines (Python's C API alone, no torch or pybind11 headers: a second to compile, where a real op
# takes a minute) that reports the SIMD level its compiler flags selected.
TINY_OP = """
#include <Python.h>
#if defined(__AVX512F__)
static const char* level = "avx512";
#elif defined(__AVX2__)
static const char* level = "avx2";
#else
static const char* level = "scalar";
#endif
#define JOIN(a, b) JOIN_(a, b)
#define JOIN_(a, b) a##b
#define TEXT(a) TEXT_(a)
#define TEXT_(a) #a
static PyObject* simd_level(PyObject*, PyObject*) { return PyUnicode_FromString(level); }
static PyMethodDef methods[] = {{"simd_level", simd_level, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, TEXT(TORCH_EXTENSION_NAME), nullptr, -1, methods};
PyMODINIT_FUNC JOIN(PyInit_, TORCH_EXTENSION_NAME)() { return PyModule_Create(&module); }
"""

LOAD_TINY = """
    import json, sys
    from pathlib import Path
    from op_builder.builder import OpBuilder

    class Tiny(OpBuilder):
        NAME = "tiny"

        def sources(self):
            return [Path(sys.argv[1])]

        def include_dirs(self):
            return []

    b = Tiny()
    m = b.load()
    print(json.dumps({"source": b.last_load.source, "simd": m.simd_level(), "path": b.last_load.path}))
"""


def test_build_from_an_empty_cache_then_load_from_cache_without_compiling(tmp_path: Path):
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY_OP)
    env = {"DSRUN_OPS_CACHE": str(tmp_path / "cache")}
    first = run_python(LOAD_TINY, env, args=[str(source)])
    assert first.returncode == 0, first.stderr
    built = json.loads(first.stdout.strip().splitlines()[-1])
    assert built["source"] == "built" and built["path"].startswith(str(tmp_path / "cache"))
    assert built["simd"] == op_builder.simd_level()  # the op's flags reached the compiler

    # CXX=false: had anything tried to compile, the load would fail
    second = run_python(LOAD_TINY, {**env, "CXX": "false"}, args=[str(source)])
    assert second.returncode == 0, second.stderr
    cached = json.loads(second.stdout.strip().splitlines()[-1])
    # a cache hit imports the library directly: no ninja run, no compiler
    assert cached["source"] == "cache" and cached["path"] == built["path"]


def test_cached_load_does_not_invoke_the_compiler(monkeypatch: pytest.MonkeyPatch):
    builder = get_builder("cpu_adam")
    builder.load()  # built (or cached) once for the whole suite

    def no_compiling(*args, **kwargs):
        raise AssertionError("a cached op must not be compiled again")

    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(cpp_extension, "load", no_compiling)
    again = get_builder("cpu_adam")
    again.load()
    assert again.last_load.source in ("cache", "prebuilt")
    assert again.is_built()


def test_cache_key_tracks_sources_flags_and_simd_level(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    builder = get_builder("cpu_adam")
    key = builder.cache_key()
    assert key == get_builder("cpu_adam").cache_key()
    monkeypatch.setenv("DSRUN_SIMD", "scalar")
    assert get_builder("cpu_adam").cache_key() != key
    monkeypatch.delenv("DSRUN_SIMD")

    class Edited(OpBuilder):
        NAME = "edited"

        def sources(self):
            return [tmp_path / "op.cpp"]

    (tmp_path / "op.cpp").write_text("int f() { return 1; }\n")
    before = Edited().cache_key()
    (tmp_path / "op.cpp").write_text("int f() { return 2; }\n")
    assert Edited().cache_key() != before


class BrokenBuilder(OpBuilder):
    NAME = "broken"

    def __init__(self, source: Path):
        super().__init__()
        self._source = source

    def sources(self):
        return [self._source]


def test_a_failed_build_raises_at_once_with_the_compilers_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("DSRUN_OPS_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "broken.cpp"
    source.write_text("int broken( { return 0; }\n")
    with pytest.raises(OpBuildError) as err:
        BrokenBuilder(source).load()
    message = str(err.value)
    assert "building op 'broken'" in message
    assert "broken.cpp" in message and "error" in message  # the compiler's own diagnostic


def test_no_compiler_raises_compiler_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("DSRUN_OPS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "false")
    source = tmp_path / "fine.cpp"
    source.write_text("int fine() { return 0; }\n")
    with pytest.raises(CompilerUnavailableError, match="no working C\\+\\+ compiler.*'false --version'"):
        BrokenBuilder(source).load()


def test_cxx_false_falls_back_to_torch_with_one_warning(tmp_path: Path):
    code = """
        import warnings, torch
        from dsrun.ops.adam import DeepSpeedCPUAdam
        from dsrun.ops.lion import DeepSpeedCPULion
        from dsrun.ops.aio import AsyncIOHandle
        from dsrun.ops.loader import OpFallbackWarning
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            p = torch.nn.Parameter(torch.ones(10))
            r = torch.nn.Parameter(torch.ones(10))
            opts = [DeepSpeedCPUAdam([p], lr=0.1), DeepSpeedCPUAdam([p], lr=0.1)]
            ref = torch.optim.AdamW([r], lr=0.1, weight_decay=0)
            p.grad = torch.full((10,), 0.5); r.grad = p.grad.clone()
            opts[0].step(); ref.step()
            assert not opts[0].uses_compiled_op
            assert torch.allclose(p, r), (p, r)
            h = AsyncIOHandle()
            t = torch.arange(7.0); h.sync_pwrite(t, "x.bin"); u = torch.empty(7); h.sync_pread(u, "x.bin")
            assert torch.equal(t, u) and h.get_engine() == "python"
        fallback = [w for w in caught if issubclass(w.category, OpFallbackWarning)]
        print(len([w for w in fallback if "cpu_adam" in str(w.message)]))
        print(str(fallback[0].message))
    """
    env = {"DSRUN_OPS_CACHE": str(tmp_path / "cache"), "CXX": "false"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, stdin=subprocess.DEVNULL,
                          env={**os.environ, **env, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    count, message = proc.stdout.strip().splitlines()[-2:]
    assert count == "1"  # two optimizers, one warning
    assert "no working C++ compiler" in message and "pure-torch" in message and "CXX" in message


def test_simd_override_is_validated(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("DSRUN_SIMD", "sse9")
    with pytest.raises(ValueError, match="avx512, avx2, scalar"):
        op_builder.simd_level()
    monkeypatch.setenv("DSRUN_SIMD", "scalar")
    assert op_builder.simd_level() == "scalar"


def test_unknown_op_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="cpu_adam"):
        get_builder("cpu_adma")


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("level", ["scalar", "avx2"])
def test_other_simd_levels_build_and_match_torch(level: str):
    if level == "avx2" and "avx2" not in op_builder.builder.cpu_flags():
        pytest.skip("this CPU has no AVX2")
    code = """
        import torch
        from dsrun.ops.adam import DeepSpeedCPUAdam
        torch.manual_seed(0)
        for n in (1, 7, 1023, 100_003):
            p = torch.nn.Parameter(torch.randn(n)); r = torch.nn.Parameter(p.detach().clone())
            q = torch.nn.Parameter(torch.randn(n).bfloat16())
            o, ro = DeepSpeedCPUAdam([p, q], lr=1e-2, weight_decay=0.1), torch.optim.AdamW([r], lr=1e-2, weight_decay=0.1)
            assert o.op.simd_level() == "%s"
            for _ in range(20):
                g = torch.randn(n); p.grad = g; r.grad = g.clone(); q.grad = g.bfloat16(); o.step(); ro.step()
            assert ((p - r).abs().max() / r.abs().max()).item() <= 20 * 4 * 2.0 ** -24  # tests/tolerance.py elementwise_bound(20)
            assert torch.equal(q.data, o.state[q]["master_param"].bfloat16())
        print("ok")
    """ % {"scalar": "scalar", "avx2": "AVX2"}[level]
    # the op cache every run shares: the session start (tests/conftest.py) compiles each level once per machine
    require_built_op("cpu_adam", simd=level)
    proc = run_python(code, {"DSRUN_SIMD": level})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


def test_a_build_is_announced_by_local_rank_0_only(monkeypatch, capsys, tmp_path):
    """The ranks of a node build an op together; one line says so, not one per rank."""
    from op_builder.builder import announce_build

    said = []
    for local_rank in ("0", "1", "2"):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        said.append(announce_build("cpu_adam", tmp_path))
    monkeypatch.delenv("LOCAL_RANK")  # a plain script, no launcher: it says so too
    said.append(announce_build("cpu_adam", tmp_path))
    assert said == [True, False, False, True]
    assert capsys.readouterr().err.count("[dsrun] building op 'cpu_adam'") == 2


def test_a_build_says_when_it_is_done_and_how_long_it_took(monkeypatch, capsys, tmp_path):
    """"building op ..." was followed by silence until the ranks' next line; the end of the build is a line
    too, with its duration (the compiler is faked: the lines, not the compiling, are under test)."""
    import re
    import types

    import torch.utils.cpp_extension as cpp_extension

    from op_builder import builder as builder_module

    monkeypatch.setenv("DSRUN_OPS_CACHE", str(tmp_path))  # an empty cache: the op must be built
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(builder_module, "compiler", lambda: builder_module.CompilerInfo("c++", True, "test"))
    compiled = types.ModuleType("compiled_cpu_lion")
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: compiled)
    builder = get_builder("cpu_lion")
    monkeypatch.setattr(builder, "prebuilt_available", lambda: False)
    monkeypatch.delitem(sys.modules, builder.module_name(), raising=False)  # loaded by an earlier test
    assert builder.load() is compiled and builder.last_load.source == "built"
    building, built = capsys.readouterr().err.splitlines()
    assert building.startswith("[dsrun] building op 'cpu_lion' (first use; cached in ")
    assert re.fullmatch(r"\[dsrun\] built op 'cpu_lion' in \d+\.\d s", built), built
