"""The base op builder: find sources, pick flags, build through ``torch.utils.cpp_extension`` and cache.

A load tries, in order:

1. a module built at install time (``DSRUN_BUILD_OPS=1 pip install .``), importable as
   ``op_builder._prebuilt.<name>``;
2. the JIT cache: ``<cache>/<name>-<key>/dsrun_<name>_<key>.so``, imported directly (no ninja, no compiler,
   well under a second). ``key`` hashes the sources and headers, the compile and link flags, the torch
   version and the Python ABI, so any change to one of them builds afresh into a new folder;
3. a JIT build with ninja into that folder.

A build that fails raises :class:`OpBuildError` at once, carrying the compiler's own output. With no working
C++ compiler (``CXX`` unset and no ``c++`` on PATH, or ``CXX=false``) the build raises
:class:`CompilerUnavailableError`, which the wrappers in ``dsrun.ops`` turn into a pure-torch fallback and one
warning.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

_PACKAGE_DIR = Path(__file__).resolve().parent
SIMD_LEVELS = ("avx512", "avx2", "scalar")
_SIMD_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
               "-DDSRUN_SIMD_AVX512"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DDSRUN_SIMD_AVX2"],
    "scalar": [],
}
# CPU flags (from /proc/cpuinfo) each level needs.
_SIMD_CPU_FLAGS = {
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"},
    "avx2": {"avx2", "fma", "f16c"},
    "scalar": set(),
}


class OpBuildError(RuntimeError):
    """Building a compiled op failed; the message holds the compiler's output."""


class CompilerUnavailableError(OpBuildError):
    """There is no working C++ compiler, so nothing can be built (the wrappers fall back to torch)."""


def csrc_root() -> Path:
    """Where the C++ sources live: ``csrc/`` beside the package in a checkout, ``op_builder/_csrc`` in a wheel."""
    checkout = _PACKAGE_DIR.parent / "csrc"
    if checkout.is_dir():
        return checkout
    return _PACKAGE_DIR / "_csrc"


def cache_root() -> Path:
    """The JIT cache: ``$DSRUN_OPS_CACHE``, else ``$TORCH_EXTENSIONS_DIR/dsrun``, else ``~/.cache/dsrun/ops``."""
    if os.environ.get("DSRUN_OPS_CACHE"):
        return Path(os.environ["DSRUN_OPS_CACHE"]).expanduser()
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"]).expanduser() / "dsrun"
    return Path.home() / ".cache" / "dsrun" / "ops"


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where that file does not exist)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _extra_simd_flags(level: str) -> list[str]:
    # bf16 conversion in one instruction where the CPU has it (the code checks __AVX512BF16__).
    return ["-mavx512bf16"] if level == "avx512" and "avx512_bf16" in cpu_flags() else []


def simd_level() -> str:
    """The SIMD level to build for: the best the CPU supports, or ``$DSRUN_SIMD`` (avx512, avx2, scalar)."""
    wanted = os.environ.get("DSRUN_SIMD", "").strip().lower()
    flags = cpu_flags()
    if wanted:
        if wanted not in SIMD_LEVELS:
            raise ValueError(f"DSRUN_SIMD={wanted!r} is not a SIMD level; expected one of {', '.join(SIMD_LEVELS)}")
        missing = _SIMD_CPU_FLAGS[wanted] - flags
        if missing:
            raise ValueError(f"DSRUN_SIMD={wanted!r} needs CPU flags this machine lacks: {', '.join(sorted(missing))}")
        return wanted
    return next(level for level in SIMD_LEVELS if _SIMD_CPU_FLAGS[level] <= flags)


@dataclass(frozen=True)
class CompilerInfo:
    command: str
    ok: bool
    version: str  # first line of `--version`, or why it does not work


@functools.lru_cache(maxsize=8)
def _probe_compiler(command: str) -> CompilerInfo:
    argv = shlex.split(command) or ["c++"]
    if shutil.which(argv[0]) is None:
        return CompilerInfo(command, False, f"'{argv[0]}' is not on PATH")
    try:
        proc = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as err:
        return CompilerInfo(command, False, f"'{command} --version' failed: {err}")
    first = (proc.stdout or proc.stderr).strip().splitlines()[:1]
    if proc.returncode != 0 or not first:
        return CompilerInfo(command, False, f"'{command} --version' exited with {proc.returncode} and printed nothing"
                            if not first else f"'{command} --version' exited with {proc.returncode}")
    return CompilerInfo(command, True, first[0])


def compiler() -> CompilerInfo:
    """The C++ compiler torch's extension builder will use (``$CXX``, default ``c++``) and whether it works."""
    return _probe_compiler(os.environ.get("CXX", "c++"))


@dataclass
class LoadInfo:
    """How the last :meth:`OpBuilder.load` got its module."""

    source: str  # "prebuilt", "cache" or "built"
    path: str
    seconds: float


class OpBuilder:
    """One compiled op. Subclasses set ``NAME`` and ``SOURCES`` (paths relative to ``csrc/``)."""

    NAME = ""
    SOURCES: tuple[str, ...] = ()
    INCLUDES: tuple[str, ...] = ("includes",)

    def __init__(self) -> None:
        self.last_load: LoadInfo | None = None

    # ------------------------------------------------------------------ what to build
    def sources(self) -> list[Path]:
        return [csrc_root() / s for s in self.SOURCES]

    def include_dirs(self) -> list[Path]:
        return [csrc_root() / d for d in self.INCLUDES]

    def simd_level(self) -> str:
        return simd_level()

    def cxx_flags(self) -> list[str]:
        # -ffp-contract=off: kernels decide where fma is used, so vector body and scalar tail round alike.
        return ["-O3", "-std=c++17", "-fopenmp", "-ffp-contract=off", *_SIMD_FLAGS[self.simd_level()],
                *_extra_simd_flags(self.simd_level())]

    def ld_flags(self) -> list[str]:
        return ["-fopenmp"]

    def is_compatible(self) -> tuple[bool, str]:
        """Whether this op can run here (it may still need building); the reason when it cannot."""
        return True, ""

    @staticmethod
    def installed_rocm_version() -> tuple[int, int]:
        """The ROCm (major, minor) torch was built for; (0, 0) for a CUDA or CPU torch (DeepSpeed's check)."""
        import torch

        hip = getattr(torch.version, "hip", None)
        if not hip:
            return 0, 0
        major, minor = (hip.split(".") + ["0"])[:2]
        return int(major), int(minor)

    def backend(self) -> str:
        """A short description of what the op uses (the SIMD level for the optimizers)."""
        return self.simd_level().upper()

    # ------------------------------------------------------------------ cache
    def cache_key(self) -> str:
        import torch

        digest = hashlib.sha256()
        files = list(self.sources())
        for directory in self.include_dirs():
            files.extend(sorted(p for p in directory.rglob("*") if p.is_file()))
        for path in files:
            digest.update(str(path.name).encode())
            try:
                digest.update(path.read_bytes())
            except OSError as err:
                raise OpBuildError(f"op '{self.NAME}': source {path} cannot be read ({err})") from None
        for part in (self.cxx_flags(), self.ld_flags(), [torch.__version__, sysconfig.get_config_var("SOABI") or "",
                                                         sys.version.split()[0]]):
            digest.update("\0".join(part).encode())
        return digest.hexdigest()[:16]

    def module_name(self, key: str | None = None) -> str:
        return f"dsrun_{self.NAME}_{key or self.cache_key()}"

    def build_dir(self, key: str | None = None) -> Path:
        return cache_root() / f"{self.NAME}-{key or self.cache_key()}"

    def cached_library(self) -> Path | None:
        """The cached shared library for the current sources and flags, if it was built."""
        key = self.cache_key()
        path = self.build_dir(key) / f"{self.module_name(key)}.so"
        return path if path.is_file() else None

    def prebuilt_available(self) -> bool:
        try:
            return importlib.util.find_spec(f"op_builder._prebuilt.{self.NAME}") is not None
        except ImportError:
            return False

    def is_built(self) -> bool:
        return self.prebuilt_available() or self.cached_library() is not None

    # ------------------------------------------------------------------ load / build
    def load(self, verbose: bool = False) -> ModuleType:
        """The op's Python module: prebuilt, cached, or built now. Raises OpBuildError on a failed build."""
        import torch  # noqa: F401  (the extension needs libtorch loaded first)

        started = time.perf_counter()
        if self.prebuilt_available():
            module = importlib.import_module(f"op_builder._prebuilt.{self.NAME}")
            self.last_load = LoadInfo("prebuilt", str(module.__file__), time.perf_counter() - started)
            return module
        key = self.cache_key()
        name = self.module_name(key)
        if name in sys.modules:
            self.last_load = LoadInfo("cache", str(sys.modules[name].__file__), time.perf_counter() - started)
            return sys.modules[name]
        library = self.build_dir(key) / f"{name}.so"
        if library.is_file():
            module = _import_library(name, library)
            self.last_load = LoadInfo("cache", str(library), time.perf_counter() - started)
            return module
        module = self._build(name, key, verbose)
        self.last_load = LoadInfo("built", str(getattr(module, "__file__", library)), time.perf_counter() - started)
        return module

    def _build(self, name: str, key: str, verbose: bool) -> ModuleType:
        info = compiler()
        if not info.ok:
            raise CompilerUnavailableError(
                f"cannot build op '{self.NAME}': no working C++ compiler ({info.version}); set CXX to a C++ "
                f"compiler such as g++, or build the ops ahead of time with 'dsrun ops build --all'")
        ok, why = self.is_compatible()
        if not ok:
            raise OpBuildError(f"op '{self.NAME}' is not compatible with this machine: {why}")
        from torch.utils import cpp_extension

        build_dir = self.build_dir(key)
        build_dir.mkdir(parents=True, exist_ok=True)
        announced, started = announce_build(self.NAME, build_dir), time.perf_counter()
        try:
            module = cpp_extension.load(
                name=name,
                sources=[str(s) for s in self.sources()],
                extra_cflags=self.cxx_flags(),
                extra_ldflags=self.ld_flags(),
                extra_include_paths=[str(d) for d in self.include_dirs()],
                build_directory=str(build_dir),
                verbose=verbose,
            )
        except (RuntimeError, subprocess.CalledProcessError, OSError) as err:
            raise OpBuildError(f"building op '{self.NAME}' in {build_dir} failed; the compiler said:\n{err}") from None
        if announced:
            print(f"[dsrun] built op '{self.NAME}' in {time.perf_counter() - started:.1f} s", file=sys.stderr,
                  flush=True)
        return module


# DeepSpeed's default CUDA targets when TORCH_CUDA_ARCH_LIST and the caller name none (before the toolkit's own)
DEFAULT_COMPUTE_CAPABILITIES = "6.0;6.1;7.0"


def installed_cuda_version() -> tuple[int, int]:
    """The CUDA toolkit's (major, minor) from ``nvcc -V`` under torch's ``CUDA_HOME``; OpBuildError without one."""
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        raise OpBuildError("CUDA_HOME does not exist, unable to compile CUDA op(s)")
    nvcc = os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")
    try:
        words = subprocess.check_output([nvcc, "-V"], text=True).split()
    except (OSError, subprocess.SubprocessError) as err:
        raise OpBuildError(f"unable to run {nvcc}, unable to compile CUDA op(s): {err}") from None
    major, minor = words[words.index("release") + 1].rstrip(",").split(".")[:2]
    return int(major), int(minor)


class CUDAOpBuilder(OpBuilder):
    """A DeepSpeed CUDA op: DeepSpeed's build plan for it (the target compute capabilities each op keeps,
    ``compute_capability_args``' ``-gencode`` flags, ``nvcc_args``, the header search a subclass does), which
    dsrun computes as DeepSpeed does but never builds: dsrun compiles CPU ops only, so ``is_compatible()`` is
    False with the reason and ``load()`` raises :class:`OpBuildError`."""

    def __init__(self, name: str | None = None) -> None:
        super().__init__()
        self.name = self.NAME if name is None else name
        self.error_log: str | None = None
        self.enable_bf16 = False

    def warning(self, msg: str) -> None:
        """DeepSpeed's builder warning: kept as ``error_log`` and printed."""
        self.error_log = msg
        print(f"[WARNING] {msg}", file=sys.stderr, flush=True)

    @staticmethod
    def is_rocm_pytorch() -> bool:
        import torch

        return getattr(torch.version, "hip", None) is not None

    def cuda_capability_major(self) -> int | None:
        """Device 0's compute-capability major, only where a CUDA context already exists (probing would create
        one, which a forked child could not use); None otherwise."""
        import torch

        if not torch.cuda.is_initialized() or getattr(torch.cuda, "_is_in_bad_fork", lambda: False)():
            return None
        return torch.cuda.get_device_properties(0).major

    def include_paths(self) -> list[str]:
        return []

    def filter_ccs(self, ccs: list[str]) -> list[list[str]]:
        """The targets this op keeps, each split as ``[major, minor]`` (``"8.0+PTX"`` -> ``["8", "0+PTX"]``);
        a subclass drops those its kernels cannot run on, and says which."""
        return [cc.split(".") for cc in ccs]

    def compute_capability_args(self, cross_compile_archs: str | None = None) -> list[str]:
        """One ``-gencode ... code=sm_XY`` flag per target (and a ``compute_XY`` PTX flag where any spelling of
        it asks for ``+PTX``), sorted and without duplicates; the targets are ``TORCH_CUDA_ARCH_LIST`` (``;`` or
        spaces), else ``cross_compile_archs``, else DeepSpeed's defaults, then :meth:`filter_ccs`."""
        archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
        archs = archs.replace(" ", ";") if archs is not None else (cross_compile_archs or DEFAULT_COMPUTE_CAPABILITIES)
        ccs = self.filter_ccs([cc.strip() for cc in archs.split(";") if cc.strip()])
        if not ccs:
            raise RuntimeError(f"Unable to load {self.name} op due to no compute capabilities remaining after "
                               "filtering")
        ptx: dict[tuple[int, int], bool] = {}
        for major, minor in ccs:
            key = (int(major), int(minor.split("+")[0]))
            ptx[key] = ptx.get(key, False) or minor.endswith("+PTX")
        self.enable_bf16 = all(major > 7 for major, _ in ptx)
        args = []
        for (major, minor), has_ptx in sorted(ptx.items()):
            args.append(f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}")
            if has_ptx:
                args.append(f"-gencode=arch=compute_{major}{minor},code=compute_{major}{minor}")
        return args

    def nvcc_args(self) -> list[str]:
        """DeepSpeed's nvcc flags for this op; none where there is no CUDA toolkit (DeepSpeed then builds the
        op's C++ part only)."""
        try:
            cuda_major, cuda_minor = installed_cuda_version()
        except OpBuildError:
            return []
        std = "-std=c++14" if cuda_major <= 10 else "-std=c++20" if (cuda_major, cuda_minor) >= (12, 5) else "-std=c++17"
        threads = os.environ.get("DS_NVCC_THREADS", "")
        threads = int(threads) if threads.isdigit() and int(threads) > 0 else min(os.cpu_count() or 1, 8)
        args = ["-O3", "--use_fast_math", std, "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                "-U__CUDA_NO_HALF2_OPERATORS__", f"--threads={threads}"]
        if os.environ.get("DS_DEBUG_CUDA_BUILD", "0") == "1":
            args.append("--ptxas-options=-v")
        return args + self.compute_capability_args()

    def is_compatible(self, verbose: bool = False) -> tuple[bool, str]:
        return False, f"op '{self.name}' is a DeepSpeed CUDA kernel dsrun does not build (dsrun compiles CPU ops only)"

    def load(self, verbose: bool = False) -> ModuleType:
        raise OpBuildError(self.is_compatible()[1])


def announce_build(name: str, build_dir: Path) -> bool:
    """Say that op ``name`` is being compiled (30-60 s on first use, so a quiet pause is not mistaken for a
    hang), once per machine: the ranks of a node build it together, and only local rank 0 says so."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return False
    print(f"[dsrun] building op '{name}' (first use; cached in {build_dir})", file=sys.stderr, flush=True)
    return True


def _import_library(name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[name] = module
    return module
