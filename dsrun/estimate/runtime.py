"""The resident memory of a rank before it holds any tensor: measured once on this host, then cached.

A rank on the CPU is a whole Python process: the interpreter, torch's libraries, numpy, Hydra and dsrun,
the gloo process group, and, from the first ``torch.optim.Optimizer`` on, the modules that torch's optimizer
machinery imports (sympy and the compiler stack: about 70 MiB with torch 2.x). None of it is a tensor and
none of it can be derived from the model, so it is measured: :func:`measure_rank_runtime` starts a tiny
subprocess (:mod:`dsrun.probe`) with the rank's environment (``OMP_NUM_THREADS``,
``MALLOC_MMAP_THRESHOLD_``) that

1. imports what a rank imports (``dsrun.worker``: torch, numpy, omegaconf, Hydra, dsrun);
2. initialises a one-rank gloo process group;
3. builds the recipe's model class at a tiny size (:func:`tiny_model_config`: 1 layer, width 64) in the
   recipe's precision, and the recipe's optimizer through dsrun's registry (which loads the compiled op it
   uses); runs an eval forward and two training steps, so the kernels a real step runs have their library
   code mapped and torch's thread pool started; and one all-reduce;
4. opens the monitors the recipe enables (CSV, TensorBoard, MLflow, in a temporary folder) and writes one
   event, as rank 0 does: MLflow's client and its SQLite store hold ~160 MiB of rank 0's memory (``monitors``,
   counted for rank 0 only);

and reports its resident memory (``VmRSS``) and peak (``VmHWM``). The result is cached under
``$DSRUN_CACHE_DIR`` (or ``~/.cache/dsrun``) in ``estimate/`` per host, Python and its environment, torch and dsrun version,
thread count, allocator setting, optimizer, model class and precision, so later estimates cost nothing; each
entry records when it was measured (the estimate's sources line shows its age). The same code measures a few
percent apart on one host hours apart (how much of torch's libraries a start-up maps depends on the page
cache), so ``dsrun estimate-memory --measure`` probes afresh before comparing with a run it makes now, and
``--refresh-runtime`` does so on request.
What it does not see grows with the model and is estimated term by term (model states, activations,
buffers, collective temporaries, the data pipeline). The estimate uses the
resident figure: a rank's peak comes long after start-up, when import-time transients are gone.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from dsrun.utils.errors import Problem, UserError

PROBED_MONITORS = ("csv_monitor", "tensorboard", "mlflow")  # rank 0's local sinks; wandb and comet need accounts
MALLOC_MMAP_THRESHOLD = "65536"  # what dsrun's --measure runs use: large blocks go back to the system at once


def enabled_monitors(ds_cfg: dict | None) -> list[str]:
    """The local monitor sections a recipe's (resolved) DeepSpeed config enables: rank 0 opens them."""
    ds_cfg = ds_cfg or {}
    return [s for s in PROBED_MONITORS if isinstance(ds_cfg.get(s), dict) and ds_cfg[s].get("enabled") is True]


def malloc_threshold() -> str:
    """The ``MALLOC_MMAP_THRESHOLD_`` a measured rank runs with: the environment's, else ours."""
    return os.environ.get("MALLOC_MMAP_THRESHOLD_", MALLOC_MMAP_THRESHOLD)


def tiny_model_config(model_cfg: dict | None) -> dict:
    """The recipe's model at a tiny size (same class, so the probe runs the same kernels): GPT-style
    configs get 1 layer, width 64, 4 heads, 16 positions; anything else is left out (a small MLP runs)."""
    if not model_cfg or "_target_" not in model_cfg:
        return {}
    keys = ("n_layer", "n_embd", "n_head", "block_size")
    if not all(k in model_cfg for k in keys):
        return {}
    tiny = dict(model_cfg)
    tiny.update(n_layer=1, n_embd=64, n_head=4, block_size=16)
    for key in ("ffn_hidden", "n_kv_head"):
        if key in tiny and tiny[key] is not None:
            tiny.pop(key)
    return tiny


@dataclass(frozen=True)
class RankRuntime:
    """An idle rank's memory on this host: ``resident`` (VmRSS after start-up, bytes), ``peak`` (VmHWM),
    ``monitors`` (what opening rank 0's monitors added to VmRSS; the other ranks open none), what it was
    measured with (``threads``, ``optimizer``, ``torch``, ``python``, ``host``) and when (``measured_at``,
    seconds since the epoch; 0 for entries cached before it was recorded)."""

    resident: int
    peak: int
    threads: int
    optimizer: str
    torch: str
    python: str
    host: str
    monitors: int = 0
    measured_at: float = 0.0

    def age_text(self, now: float | None = None) -> str:
        """How long ago the probe ran, for the estimate's sources line ("measured 3 h ago")."""
        if not self.measured_at:
            return "cached, age unknown"
        age = max(0.0, (time.time() if now is None else now) - self.measured_at)
        for unit, seconds in (("d", 86400), ("h", 3600), ("min", 60)):
            if age >= seconds:
                return f"measured {age / seconds:.0f} {unit} ago"
        return "measured just now"


def _cache_dir() -> Path:
    root = os.environ.get("DSRUN_CACHE_DIR") or str(Path.home() / ".cache" / "dsrun")
    return Path(root) / "estimate"


def _versions() -> tuple[str, str, str, str]:
    import torch

    import dsrun

    return torch.__version__, platform.python_version(), platform.node(), getattr(dsrun, "__version__", "0")


def runtime_cache_path(threads: int, optimizer: str, model: dict | None = None, precision: str = "fp32",
                       monitors: Sequence[str] = ()) -> Path:
    """Where the probe's result for these settings is cached (one small JSON file)."""
    torch_version, python, host, dsrun_version = _versions()
    # sys.prefix: the same torch freshly installed in another venv maps more of its library pages at import
    # (measured: +54 MiB RSS after `import torch` in a new venv), so a probe never stands for another environment
    key = json.dumps([torch_version, python, sys.prefix, host, dsrun_version, int(threads), optimizer.lower(),
                      tiny_model_config(model), precision,
                      malloc_threshold()] + ([sorted(monitors)] if monitors else []),
                     sort_keys=True, default=str)
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    return _cache_dir() / f"rank-runtime-{digest}.json"


def cached_rank_runtime(threads: int, optimizer: str, model: dict | None = None, precision: str = "fp32",
                        monitors: Sequence[str] = ()) -> RankRuntime | None:
    """What :func:`measure_rank_runtime` measured before for these settings, or None (never measured, or an
    old or damaged cache entry)."""
    try:
        return RankRuntime(**json.loads(runtime_cache_path(threads, optimizer, model, precision,
                                                           monitors).read_text()))
    except (OSError, TypeError, ValueError):
        return None


def measure_rank_runtime(threads: int = 1, optimizer: str = "AdamW", model: dict | None = None,
                         precision: str = "fp32", refresh: bool = False, timeout: float = 180,
                         monitors: Sequence[str] = ()) -> RankRuntime:
    """The resident memory of an idle rank with ``threads`` OpenMP threads, ``optimizer``, and the class of
    ``model`` (a Hydra config with ``_target_``; None: a small MLP) in ``precision``, with rank 0's
    ``monitors`` open (enabled DeepSpeed monitor sections; see the module docstring); from the cache unless
    ``refresh``."""
    cached = None if refresh else cached_rank_runtime(threads, optimizer, model, precision, monitors)
    if cached is not None:
        return cached
    path = runtime_cache_path(threads, optimizer, model, precision, monitors)
    # The optimizer's params do not change what it imports or loads: the probe uses its defaults.
    env = {**os.environ, "OMP_NUM_THREADS": str(int(threads)),
           "MALLOC_MMAP_THRESHOLD_": malloc_threshold()}
    repo_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, env.get("PYTHONPATH", "")]))
    try:
        dtype = {"fp16": "float16", "bf16": "bfloat16"}.get(precision, "float32")
        result = subprocess.run([sys.executable, "-m", "dsrun.probe", optimizer,
                                 json.dumps(tiny_model_config(model)), dtype, json.dumps(sorted(monitors))],
                                env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise UserError(Problem("estimate runtime probe", f"did not finish in {timeout:g}s",
                                "retry when the machine is less busy, or pass --rank-runtime")) from None
    lines = [line for line in result.stdout.splitlines() if line.startswith("DSRUN_PROBE ")]
    if (result.returncode != 0 or not lines) and (model or optimizer.lower() != "adamw"):
        # a model class or optimizer the probe cannot run on its own: an idle rank with AdamW and a small MLP
        generic = measure_rank_runtime(threads, "AdamW", None, precision, refresh, timeout, monitors)
        return RankRuntime(**{**asdict(generic), "optimizer": f"{optimizer} (probed as AdamW + MLP)"})
    if result.returncode != 0 or not lines:
        tail = " | ".join((result.stderr or result.stdout).strip().splitlines()[-3:])
        raise UserError(Problem("estimate runtime probe", f"failed (exit code {result.returncode}): {tail}",
                                "pass --rank-runtime to give the figure yourself"))
    status = json.loads(lines[-1].split(" ", 1)[1])
    torch_version, python, host, _ = _versions()
    idle = int(status.get("idle", status["VmRSS"]))
    runtime = RankRuntime(resident=idle, peak=int(status["VmHWM"]), threads=int(threads), optimizer=optimizer,
                          torch=torch_version, python=python, host=host, monitors=max(0, int(status["VmRSS"]) - idle),
                          measured_at=time.time())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(runtime)))
    except OSError:
        pass  # a read-only home: measure again next time
    return runtime


def rank_threads(ranks_per_node: int) -> int:
    """OpenMP threads a CPU rank gets from dsrun's launcher: ``OMP_NUM_THREADS`` if set, else the launcher's
    default (:func:`dsrun.launcher.environment.default_omp_threads`)."""
    if os.environ.get("OMP_NUM_THREADS"):
        try:
            return max(1, int(os.environ["OMP_NUM_THREADS"]))
        except ValueError:
            pass
    from dsrun.launcher.environment import default_omp_threads

    return default_omp_threads(ranks_per_node)
