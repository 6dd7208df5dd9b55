"""The runtime probe of :mod:`dsrun.estimate.runtime`: a one-rank process that does what a rank does at a
tiny size and reports its resident memory. Run as ``python -m dsrun.probe OPTIMIZER MODEL_JSON DTYPE``;
the last line it prints is ``DSRUN_PROBE {"VmRSS": bytes, "VmHWM": bytes}``.

It imports what a rank imports (``dsrun.worker``: torch, numpy, omegaconf, Hydra, the engine), makes a
one-rank gloo world through :mod:`dsrun.comm`, builds the model (a Hydra config; ``{}``: a small MLP) in
``DTYPE`` and the optimizer through dsrun's registry, runs an eval forward, two training steps and one
all-reduce. It sits with the rank entry points in docs/architecture.md's layer table, above the engine.
"""
from __future__ import annotations

import json
import sys
import tempfile
from typing import Any, Sequence

import torch

import dsrun.worker  # noqa: F401  (what a rank imports, the engine included)
from dsrun import comm
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


def main(argv: Sequence[str] | None = None) -> int:
    optimizer_type, model_json, dtype_name = (sys.argv[1:] if argv is None else list(argv))[:3]
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
    comm.destroy_process_group()
    print("DSRUN_PROBE " + json.dumps(status()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
