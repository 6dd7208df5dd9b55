"""Peak memory of loading a model states file's module into the live module at ZeRO stages 0-2: read whole and
copied by ``load_state_dict`` (before) against read straight into the live tensors
(``partial_state.read_module_into``, docs/checkpoint.md "Partial reads").

    PYTHONPATH=. python benchmarks/module_read_memory.py [--model gpt-small] [--dir D]

Saves ``--model``'s fp32 module as a model states file (``{"module": state_dict}``, torch's zip format), then in
a fresh process per mode builds the model, resets VmHWM (``clear_refs``) and loads the file: ``whole`` =
``safe_load.load_file`` + ``load_state_dict``; ``in place`` = ``model_states_without_parameters(...,
module_unread=True)`` + ``read_module_into`` + ``load_state_dict``. Prints each mode's peak above the RSS before
the load, the module's bytes, and whether the loaded module equals the saved one bit for bit.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def _rss(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _model(name: str):
    import torch
    from dsrun.models.registry import build_model
    torch.manual_seed(0)
    return build_model(name, block_size=64)


def _load(name: str, path: Path, mode: str) -> dict:
    import torch
    from dsrun.checkpoint import partial_state
    from dsrun.checkpoint.safe_load import load_file
    model = _model(name)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # the load must overwrite them
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss("VmRSS")
    if mode == "whole":
        model.load_state_dict(load_file(path)["module"])
    else:
        states = partial_state.model_states_without_parameters(path, set(), module_unread=True)
        model.load_state_dict(partial_state.read_module_into(model, states["module"], path))
    peak = _rss("VmHWM") - before
    saved = _model(name).state_dict()
    equal = all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    module = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in saved.values()}.values())
    return {"mode": mode, "peak": peak, "module": module, "equal": equal}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--load", nargs=2, help=argparse.SUPPRESS)  # (path, mode): one measurement, in a child
    args = parser.parse_args()
    if args.load:
        print(json.dumps(_load(args.model, Path(args.load[0]), args.load[1])))
        return
    import torch
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        path = Path(root) / "mp_rank_00_model_states.pt"
        torch.save({"module": _model(args.model).state_dict()}, path)
        for mode in ("whole", "in place"):
            out = subprocess.run([sys.executable, __file__, "--model", args.model, "--load", str(path), mode],
                                 check=True, capture_output=True, text=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            print(f"{mode:>9}: peak {row['peak'] / 2**20:7.1f} MiB above the RSS before the load "
                  f"(module {row['module'] / 2**20:.1f} MiB), bitwise equal: {row['equal']}", flush=True)


if __name__ == "__main__":
    main()
