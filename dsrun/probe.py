"""The runtime probe of :mod:`dsrun.estimate.runtime`: a one-rank process that does what a rank does at a
tiny size and reports its resident memory. Run as ``python -m dsrun.probe OPTIMIZER MODEL_JSON DTYPE
[MONITORS_JSON]``; the last line it prints is ``DSRUN_PROBE {"VmRSS": bytes, "VmHWM": bytes, "idle": bytes}`` (``idle``: VmRSS
before the monitors were opened).

It imports what a rank imports (``dsrun.worker``: torch, numpy, omegaconf, Hydra, the engine), makes a
one-rank gloo world through :mod:`dsrun.comm`, builds the model (a Hydra config; ``{}``: a small MLP) in
``DTYPE`` and the optimizer through dsrun's registry, runs an eval forward, two training steps and one
all-reduce, and opens the monitors rank 0 writes to (``MONITORS_JSON``: the enabled sections among
``csv_monitor``, ``tensorboard``, ``mlflow``; MLflow's client and its SQLite store alone hold ~200 MiB) in a
temporary folder, with one event written. It sits with the rank entry points in docs/architecture.md's layer table, above the engine.
"""
from __future__ import annotations

import json
import sys
import tempfile
from typing import Any, Sequence

import torch

import dsrun.worker  # noqa: F401  (what a rank imports, the engine included)
from dsrun import comm
from dsrun.estimate.runtime import PROBED_MONITORS
from dsrun.optim.registry import build_optimizer
from dsrun.optim.onebit import ONE_BIT_CLASSES, build_onebit_optimizer


def status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def _model_and_step(model_cfg: dict[str, Any], dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
    if model_cfg:
        import hydra.utils

        model = hydra.utils.instantiate(model_cfg, _convert_="all").to(dtype)
        vocab, block = model_cfg.get("vocab_size", 256), model_cfg.get("block_size", 16)
        batch = (torch.randint(0, vocab, (2, block)), torch.randint(0, vocab, (2, block)))
        return model, lambda: model(*batch)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)).to(dtype)
    x = torch.randn(2, 64, dtype=dtype)
    return model, lambda: model(x).square().sum()


def _as_loss(out: torch.Tensor | tuple | list) -> torch.Tensor:
    if isinstance(out, (tuple, list)):
        tensors = [t for t in out if torch.is_tensor(t)]
        scalars = [t for t in tensors if t.dim() == 0]
        out = scalars[-1] if scalars else tensors[0]
    return out.float().sum()


def _open_monitors(sections: Sequence[str], folder: str) -> Any:
    """Rank 0's monitors for ``sections``, writing into ``folder``, with one event written through each."""
    from dsrun.monitor.master import MonitorMaster

    config = {s: {"enabled": True, **({"tracking_uri": f"sqlite:///{folder}/mlflow.db"} if s == "mlflow" else {})}
              for s in sections if s in PROBED_MONITORS}
    monitor = MonitorMaster(config, rank=0, default_output_dir=folder, background=False)
    monitor.write_events([("Train/Samples/train_loss", 1.0, 1)])
    monitor.flush()
    return monitor


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    optimizer_type, model_json, dtype_name = args[:3]
    monitors = json.loads(args[3]) if len(args) > 3 else []
    import os

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    store = tempfile.mkdtemp(prefix="dsrun-probe-")
    comm.init_distributed(dist_backend="gloo", init_method=f"file://{store}/store", rank=0, world_size=1,
                          verbose=False)
    model, run = _model_and_step(json.loads(model_json), getattr(torch, dtype_name))
    build = build_onebit_optimizer if optimizer_type.lower() in ONE_BIT_CLASSES else build_optimizer
    optimizer = build(optimizer_type, model.parameters(), {})
    model.eval()
    with torch.no_grad():
        run()
    model.train()
    for _ in range(2):
        _as_loss(run()).backward()
        optimizer.step()
        optimizer.zero_grad()
    comm.all_reduce(torch.ones(1))
    idle = status()["VmRSS"]
    opened = _open_monitors(monitors, store) if monitors else None
    comm.destroy_process_group()
    print("DSRUN_PROBE " + json.dumps({**status(), "idle": idle}), flush=True)
    if opened is not None:
        opened.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
