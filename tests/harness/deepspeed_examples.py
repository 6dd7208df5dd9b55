"""DeepSpeedExamples' pipeline example (``training/pipeline_parallelism/train.py``), run unedited.

The script and its config are stored byte for byte in tests/assets/deepspeed_examples/pipeline_parallelism
(:func:`prepare_example` copies the script out and checks its git blob id). Around it, what this machine lacks:

* torchvision: PyPI's wheels do not import beside the CPU build of torch, so tests/assets/torchvision_standin
  (its README) serves the names the script uses, with torchvision's layers, transforms and CIFAR10 reader;
* CIFAR-10: :func:`write_cifar10` writes random CIFAR-shaped batches in the pickled folder format, each class
  a fixed colour pattern plus noise (so the loss falls), and ``TORCHVISION_STANDIN_CIFAR10_ROOT`` points the
  stand-in at it (the script hard-codes ``/tmp/cifar10-data``);
* CUDA: tests/assets/cpu_cuda_set_device makes the script's ``torch.cuda.set_device`` a no-op on a torch built
  without CUDA (it raises under DeepSpeed 0.19.8 as under dsrun).

:func:`example_env` puts those on ``PYTHONPATH``; the same environment serves dsrun's run (tests/e2e) and
DeepSpeed's (benchmarks/pipeline_example.py). The script prints nothing of its pipeline training itself; the
engine's progress line (``steps: N loss: L iter time (s): ...``, every ``steps_per_print`` batches) is what
:func:`progress_losses` reads.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
from pathlib import Path

import numpy as np

ASSETS = Path(__file__).resolve().parents[1] / "assets"
EXAMPLE = ASSETS / "deepspeed_examples" / "pipeline_parallelism"
TRAIN_BLOB = "b4bc49bf6eb317f4a9298a9b43f176e025bbd99c"  # DeepSpeedExamples 45b4b71: training/pipeline_parallelism/train.py
TORCHVISION_STANDIN = ASSETS / "torchvision_standin"
CPU_SET_DEVICE = ASSETS / "cpu_cuda_set_device"
CIFAR_ROOT_VARIABLE = "TORCHVISION_STANDIN_CIFAR10_ROOT"
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
PROGRESS = re.compile(r"^(?:\[rank\d+\]:)?steps: (\d+) loss: ([0-9.eE+-]+|nan|inf) iter time", re.MULTILINE)


def git_blob_id(data: bytes) -> str:
    """The id git gives a file's content (``git hash-object``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def prepare_example(folder: Path) -> Path:
    """Copy the example's ``train.py`` into ``folder`` (checking it is DeepSpeedExamples' file, unedited)."""
    data = (EXAMPLE / "train.py.txt").read_bytes()
    if git_blob_id(data) != TRAIN_BLOB:
        raise AssertionError("tests/assets/deepspeed_examples/pipeline_parallelism/train.py.txt is not "
                             "DeepSpeedExamples' train.py any more")
    script = Path(folder) / "train.py"
    script.write_bytes(data)
    return script


def example_config(train_batch_size: int, micro_batch_size: int, steps_per_print: int = 1) -> dict:
    """The example's ds_config.json (Adam, lr 1e-3) with smaller batches and a progress line per batch."""
    config = json.loads((EXAMPLE / "ds_config.json").read_text())
    config.update(train_batch_size=train_batch_size, train_micro_batch_size_per_gpu=micro_batch_size,
                  steps_per_print=steps_per_print)
    return config


def write_cifar10(root: Path, images_per_batch: int, seed: int = 0) -> Path:
    """``root/cifar-10-batches-py`` as CIFAR-10 ships it (five training batches, a test batch, the meta file),
    pickled dicts of ``data`` (N x 3072 uint8, channel-major) and ``labels``, holding random images: class c
    is a fixed 4x4 colour pattern of its own, upsampled to 32x32, plus noise. Returns ``root``."""
    rng = np.random.default_rng(seed)
    folder = Path(root) / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    patterns = rng.integers(40, 216, size=(len(CLASSES), 3, 4, 4)).repeat(8, axis=2).repeat(8, axis=3)

    def batch(label: str, n: int) -> dict:
        labels = rng.integers(0, len(CLASSES), size=n)
        noise = rng.normal(0, 24, size=(n, 3, 32, 32))
        images = np.clip(patterns[labels] + noise, 0, 255).astype(np.uint8)
        return {"batch_label": label, "labels": [int(x) for x in labels], "data": images.reshape(n, 3072),
                "filenames": [f"image_{i:05d}.png" for i in range(n)]}

    files = {f"data_batch_{i}": batch(f"training batch {i} of 5", images_per_batch) for i in range(1, 6)}
    files["test_batch"] = batch("testing batch 1 of 1", images_per_batch)
    for name, content in files.items():
        with open(folder / name, "wb") as fh:
            pickle.dump(content, fh, protocol=2)
    with open(folder / "batches.meta", "wb") as fh:
        pickle.dump({"label_names": CLASSES, "num_cases_per_batch": images_per_batch, "num_vis": 3072}, fh,
                    protocol=2)
    return Path(root)


def example_env(base: dict[str, str], data_root: Path) -> dict[str, str]:
    """``base`` with the stand-ins first on ``PYTHONPATH`` and the stand-in CIFAR10 pointed at ``data_root``
    (the real torchvision, where it imports, would refuse random data: it checks CIFAR-10's checksums); one
    thread per rank (two ranks share the machine)."""
    paths = [str(CPU_SET_DEVICE), str(TORCHVISION_STANDIN)]
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env[CIFAR_ROOT_VARIABLE] = str(data_root)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def example_args(steps: int, config: Path, pipeline_stages: int = 2) -> list[str]:
    """The script's arguments: its own ``-p``/``--steps``, gloo (CPU), DeepSpeed's ``--deepspeed_config``."""
    return ["--deepspeed_config", str(config), "-p", str(pipeline_stages), f"--steps={steps}", "--backend", "gloo"]


def progress_losses(stdout: str) -> dict[int, float]:
    """step -> loss from the pipeline engine's progress lines."""
    return {int(step): float(loss) for step, loss in PROGRESS.findall(stdout)}
