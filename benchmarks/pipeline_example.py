"""DeepSpeedExamples' pipeline example against DeepSpeed 0.19.8: where ``partition_method`` cuts, and the losses.

Two checks, each run by DeepSpeed in a side environment and by dsrun here:

* ``partitions``: ``partition_uniform`` / ``partition_balanced`` (``deepspeed.runtime.utils``) on a table of
  weights, and ``PipelineModule``'s cut (``parameters``, ``uniform``, ``type:REGEX``, in any case) of the
  example's models, torchvision's AlexNet and VGG-19 flattened by the example's ``join_layers`` (22 and 46
  layers), at 2, 3 and 4 stages. DeepSpeed's cut is its own ``PipelineModule._partition_layers`` on the same
  layer list (a module object holding only what that method reads: no process group is needed). Printed: each
  case's cuts on both sides; the exit status is 1 if one differs. tests/unit/pipe/test_partition.py holds the
  same figures.
* ``losses``: ``training/pipeline_parallelism/train.py``, unedited, on 2 ranks (2 stages), ``--steps`` batches
  of ``--batch`` images in micro-batches of ``--micro``, the same CIFAR-shaped data, config and seed, launched by
  DeepSpeed's ``deepspeed`` command and by ``dsrun launch --as-deepspeed``. Printed: each step's loss on both
  sides (the pipeline engine's progress line) and the largest difference. The environment around the script is
  tests/harness/deepspeed_examples.py's (a torchvision stand-in, random CIFAR-shaped batches, a no-op
  ``torch.cuda.set_device`` on a CPU torch), the same on both sides.

DeepSpeed is not a dependency of dsrun: install it in a side environment (see ``benchmarks/vs_deepspeed.py``)::

    DSRUN_DEEPSPEED_PYTHON=/path/dsvenv/bin/python python benchmarks/pipeline_example.py partitions
    DSRUN_DEEPSPEED_PYTHON=/path/dsvenv/bin/python python benchmarks/pipeline_example.py losses [--steps 20] \
        [--torch-adam] [--lr 1e-4]

``--torch-adam`` has both sides step torch's Adam instead of their own compiled CPU Adam; ``--lr`` replaces the
example's learning rate (1e-3, at which AlexNet's loss jumps to 7.5 at step 2 on both sides).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DS_PYTHON_ENV = "DSRUN_DEEPSPEED_PYTHON"

from tests.harness import deepspeed_examples as ex  # noqa: E402  (numpy and the standard library only)

WEIGHT_CASES: list[tuple[list[float], int]] = [
    ([1, 2, 1], 4), ([1, 1, 1, 1], 4), ([1, 1, 1, 1, 1], 4), ([1, 1, 1, 1, 0, 1], 4), ([0, 0, 0, 9], 2),
    ([5, 1, 1, 1, 1, 1, 5, 5], 3), ([4, 4, 4, 4, 1, 1, 1, 1], 2), ([1] * 10, 4), ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], 3),
    ([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7], 3), ([10, 0, 0, 0, 10], 2), ([7, 2, 2, 2, 7], 3), ([2**40, 1, 2**40, 1], 2),
    ([0, 1, 1, 1, 1, 0], 2), ([1, 0, 0, 1, 0, 0, 1, 0], 3),
]
MODEL_CASES: list[tuple[str, str, int]] = [
    (model, method, stages)
    for model, methods in (("alexnet", ("parameters", "uniform", "type:conv2d", "type:Linear", "TYPE:relu",
                                        "type:lambda", "Parameters")),
                           ("vgg19", ("parameters", "uniform", "type:conv", "type:linear|pool")))
    for method in methods for stages in (2, 3, 4)
]


def example_layers(model: str) -> list:
    """The example's ``join_layers`` of the stand-in torchvision model, built on the meta device."""
    import torch

    sys.path.insert(0, str(ex.TORCHVISION_STANDIN))
    from torchvision.models import AlexNet, vgg19

    with torch.device("meta"):
        net = AlexNet(num_classes=10) if model == "alexnet" else vgg19(num_classes=10)
    return [*net.features, net.avgpool, lambda x: torch.flatten(x, 1), *net.classifier]


def deepspeed_cuts() -> dict:
    """DeepSpeed's figures (run in the side environment)."""
    from torch import nn
    from deepspeed.runtime import utils as ds_utils
    from deepspeed.runtime.pipe.module import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    def module_cut(layers: list, method: str, stages: int) -> list[int]:
        module = PipelineModule.__new__(PipelineModule)
        nn.Module.__init__(module)
        module._layer_specs, module._topo, module.global_rank = layers, PipeDataParallelTopology(stages, 1), 1
        module.num_stages = stages
        module.loss_fn = None
        module._partition_layers(method=method)  # global rank 1: DeepSpeed prints nothing
        return [int(x) for x in module.parts]

    layers = {name: example_layers(name) for name in ("alexnet", "vgg19")}
    return {"weights": [[int(x) for x in ds_utils.partition_balanced(weights=w, num_parts=n)] for w, n in WEIGHT_CASES],
            "uniform": [[int(x) for x in ds_utils.partition_uniform(num_items=len(w), num_parts=n)]
                        for w, n in WEIGHT_CASES],
            "models": [module_cut(layers[m], method, n) for m, method, n in MODEL_CASES]}


def dsrun_cuts() -> dict:
    import dsrun.alias

    dsrun.alias.install()
    from deepspeed.runtime import utils as ds_utils  # the alias: dsrun's
    from dsrun.pipe.partition import partition_layers

    layers = {name: example_layers(name) for name in ("alexnet", "vgg19")}
    return {"weights": [ds_utils.partition_balanced(weights=w, num_parts=n) for w, n in WEIGHT_CASES],
            "uniform": [ds_utils.partition_uniform(num_items=len(w), num_parts=n) for w, n in WEIGHT_CASES],
            "models": [partition_layers(layers[m], n, method) for m, method, n in MODEL_CASES]}


def partitions(ds_python: str) -> int:
    done = subprocess.run([ds_python, __file__, "deepspeed-cuts"], capture_output=True, text=True, timeout=600)
    if done.returncode:
        sys.exit(f"DeepSpeed's side failed:\n{done.stderr[-3000:]}")
    theirs, ours = json.loads(done.stdout.strip().splitlines()[-1]), dsrun_cuts()
    differ = 0
    rows = [(f"partition_balanced({w}, {n})", theirs["weights"][i], ours["weights"][i])
            for i, (w, n) in enumerate(WEIGHT_CASES)]
    rows += [(f"partition_uniform({len(w)}, {n})", theirs["uniform"][i], ours["uniform"][i])
             for i, (w, n) in enumerate(WEIGHT_CASES)]
    rows += [(f"{m} {method!r} x{n}", theirs["models"][i], ours["models"][i]) for i, (m, method, n) in enumerate(MODEL_CASES)]
    for label, ds, mine in rows:
        same = list(ds) == list(mine)
        differ += not same
        print(f"{'same' if same else 'DIFFERENT':9s} {label:55s} DeepSpeed {ds}" + ("" if same else f"  dsrun {mine}"))
    print(f"{len(rows) - differ} of {len(rows)} cuts the same as DeepSpeed 0.19.8's")
    return 1 if differ else 0


def run_example(command: list[str], folder: Path, env: dict[str, str], timeout: float) -> dict[int, float]:
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if done.returncode:
        sys.exit(f"{' '.join(command[:4])} ... failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return ex.progress_losses(done.stdout)


def losses(ds_python: str, steps: int, batch: int, micro: int, images: int, torch_adam: bool, lr: float | None,
           timeout: float) -> int:
    with tempfile.TemporaryDirectory(prefix="dsrun-pipeline-example-") as tmp:
        folder = Path(tmp)
        ex.prepare_example(folder)
        config = ex.example_config(batch, micro)
        if torch_adam:  # both sides step torch.optim.Adam(W) instead of their own compiled CPU Adam
            config["optimizer"]["params"]["torch_adam"] = True
        if lr is not None:
            config["optimizer"]["params"]["lr"] = lr
        (folder / "ds_config.json").write_text(json.dumps(config))
        data = ex.write_cifar10(folder / "cifar10", images_per_batch=images)
        args = ["train.py", *ex.example_args(steps, folder / "ds_config.json")]
        ds_bin = str(Path(ds_python).parent / "deepspeed")
        env = ex.example_env(dict(os.environ), data)
        theirs = run_example([ds_bin, "--num_gpus", "2", *args], folder, env, timeout)
        ours_env = ex.example_env({**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}, data)
        ours = run_example([sys.executable, "-m", "dsrun", "launch", "--as-deepspeed", "--num_procs", "2", *args],
                           folder, ours_env, timeout)
    print(f"DeepSpeedExamples training/pipeline_parallelism/train.py, AlexNet, 2 stages, {steps} steps of {batch} "
          f"images (micro-batches of {micro}), Adam lr {config['optimizer']['params']['lr']:g}"
          f"{' (torch_adam)' if torch_adam else ''}, CIFAR-shaped "
          f"random data ({5 * images} images)")
    print(f"{'step':>5} {'DeepSpeed 0.19.8':>17} {'dsrun':>10} {'difference':>11}")
    worst = 0.0
    for step in sorted(set(theirs) | set(ours)):
        a, b = theirs.get(step), ours.get(step)
        diff = abs(a - b) if a is not None and b is not None else float("nan")
        worst = max(worst, diff) if diff == diff else float("inf")
        print(f"{step:5d} {a if a is not None else float('nan'):17.4f} {b if b is not None else float('nan'):10.4f} "
              f"{diff:11.4f}")
    print(f"largest difference of a step's loss: {worst:.4f} (the progress line rounds each to 4 decimals)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=["partitions", "losses", "deepspeed-cuts"])
    parser.add_argument("--deepspeed-python", default=None, help=f"interpreter with deepspeed (or ${DS_PYTHON_ENV})")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16, help="train_batch_size")
    parser.add_argument("--micro", type=int, default=8, help="train_micro_batch_size_per_gpu")
    parser.add_argument("--images", type=int, default=64, help="images per CIFAR batch file (5 training files)")
    parser.add_argument("--torch-adam", action="store_true", help="losses: torch's Adam on both sides")
    parser.add_argument("--lr", type=float, default=None, help="losses: Adam's lr (default: the example's 1e-3)")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    if args.check == "deepspeed-cuts":  # the side environment's half of `partitions`
        print(json.dumps(deepspeed_cuts()))
        return 0
    ds_python = args.deepspeed_python or os.environ.get(DS_PYTHON_ENV)
    if not ds_python:
        sys.exit(f"pipeline_example: pass --deepspeed-python or set {DS_PYTHON_ENV} (see the docstring)")
    if args.check == "partitions":
        return partitions(ds_python)
    return losses(ds_python, args.steps, args.batch, args.micro, args.images, args.torch_adam, args.lr, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
