"""``dsrun convert to-hf`` on a real size: the time to export a model's checkpoint and how far the exported
``GPT2LMHeadModel``'s logits are from dsrun's GPT, against the fp32 bound the tests use.

A run directory is made in a temporary folder (or ``--keep DIR``): ``resolved.yaml`` naming the model
(``--model``, default ``gpt-small``, 124M, at its random initialisation) and a checkpoint saved by a one-rank engine
at ``--stage`` (fp32, before any step: the masters are the initial weights). The export runs as a user runs it,
``python -m dsrun convert to-hf RUN_DIR OUT`` (the wall time includes the interpreter's start and imports; the
command's own figure, printed, is the export without them). Then ``AutoModelForCausalLM.from_pretrained(OUT)`` and
dsrun's GPT with the same weights compute the logits of ``--batch`` random sequences of ``--seq`` tokens; the
bound is tests/unit/checkpoint/test_to_hf.py's: ``(K + 1)`` times dsrun's own fp32 distance from its float64
logits (``K = 4``, tests/tolerance.py). Exit status 1 when the difference passes it::

    python benchmarks/hf_export.py [--model gpt-small] [--rotary] [--stage 3] [--seq 128] [--batch 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

K = 4  # tests/tolerance.py's


def _checkpoint(spec: dict, stage: int, run: Path) -> dict:
    """Save the initial weights of the model ``spec`` builds as a run's checkpoint; returns them (CPU clones)."""
    import torch
    import yaml

    import dsrun
    from dsrun import comm
    from dsrun.models.registry import build_model
    from dsrun.utils.net import free_port

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    comm.init_distributed(dist_backend="gloo", verbose=False)
    torch.manual_seed(0)
    model = build_model(spec)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=config)
    started = time.perf_counter()
    engine.save_checkpoint(str(run / "checkpoints"))
    print(f"checkpoint saved in {time.perf_counter() - started:.1f} s", flush=True)
    (run / "resolved.yaml").write_text(yaml.safe_dump({"model": spec}))
    engine.destroy()
    comm.destroy_process_group()
    return weights


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--rotary", action="store_true", help="the model with positions=rotary (a GPT-NeoX export)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--keep", type=Path, default=None, help="make the run directory and the export here")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from dsrun.models.gpt import GPT
    from dsrun.models.registry import gpt_config, model_spec

    root = args.keep or Path(tempfile.mkdtemp(prefix="hf_export_"))
    run, out = root / "run", root / "hf"
    run.mkdir(parents=True, exist_ok=True)
    spec = {**model_spec(args.model), **({"positions": "rotary"} if args.rotary else {})}
    weights = _checkpoint(spec, args.stage, run)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "dsrun", "convert", "to-hf", str(run), str(out)], text=True,
                          capture_output=True)
    wall = time.perf_counter() - started
    print(done.stdout.strip(), done.stderr.strip()[-2000:], sep="\n", flush=True)
    if done.returncode:
        return done.returncode
    config = gpt_config(spec)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(str(out)).eval()(tokens).logits
        dsrun_model = GPT(config).eval()
        dsrun_model.load_state_dict(weights)
        logits = dsrun_model(tokens)
        del dsrun_model
        wide = GPT(config).double().eval()
        wide.load_state_dict({k: v.double() for k, v in weights.items()})
        spread = (wide(tokens) - logits.double()).abs().max().item()
    diff = (exported - logits).abs().max().item()
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    result = {"model": args.model, "positions": config.positions, "stage": args.stage,
              "tokens": [args.batch, args.seq], "export_wall_s": wall, "bytes": size, "max_abs_logit_diff": diff,
              "fp32_spread": spread, "bound": (K + 1) * spread, "max_abs_logit": logits.abs().max().item()}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if diff <= (K + 1) * spread else 1


if __name__ == "__main__":
    sys.exit(main())
