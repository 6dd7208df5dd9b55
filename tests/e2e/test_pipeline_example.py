"""DeepSpeedExamples' pipeline example (``training/pipeline_parallelism/train.py``), unedited, through the
alias: ``dsrun launch --as-deepspeed --num_procs 2 train.py --deepspeed_config ds_config.json -p 2`` trains
torchvision's AlexNet cut into 2 pipeline stages where DeepSpeed cuts it, and ``-p 0`` trains it with the plain
engine on 2 data-parallel ranks (the script's two code paths). The environment around the script (a
torchvision stand-in, CIFAR-shaped random batches, a no-op ``torch.cuda.set_device`` on a CPU torch) is
tests/harness/deepspeed_examples.py's; benchmarks/pipeline_example.py runs the same against DeepSpeed 0.19.8
(docs/pipeline.md has its figures)."""
from __future__ import annotations

import json
import math
import os
import re

import pytest

from tests.harness import deepspeed_examples as ex
from tests.helpers import run_cli


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pipeline_example")
    ex.prepare_example(folder)
    (folder / "ds_config.json").write_text(json.dumps(ex.example_config(train_batch_size=16, micro_batch_size=8)))
    data = ex.write_cifar10(folder / "cifar10", images_per_batch=4)  # 20 images: the pipeline reads 32
    return folder, ex.example_env(dict(os.environ), data)


def _launch(example, stages: int, steps: int):
    folder, env = example
    return run_cli("launch", "--as-deepspeed", "--num_procs", "2", "train.py",
                   *ex.example_args(steps, folder / "ds_config.json", pipeline_stages=stages),
                   cwd=folder, env=env, timeout=240)


def test_the_example_trains_its_alexnet_on_two_pipeline_stages(example):
    result = _launch(example, stages=2, steps=2)
    assert result.returncode == 0, result.stderr[-4000:]
    losses = ex.progress_losses(result.stdout)  # DeepSpeed's progress line, every batch (steps_per_print 1)
    assert sorted(losses) == [1, 2] and all(math.isfinite(v) and v > 0 for v in losses.values())
    assert abs(losses[1] - math.log(10)) < 0.5  # ten classes, untrained: about ln 10


def test_the_example_trains_its_alexnet_data_parallel_without_a_pipeline(example):
    result = _launch(example, stages=0, steps=1)
    assert result.returncode == 0, result.stderr[-4000:]
    assert re.findall(r"\[dsrun\] step=(\d+), skipped=0", result.stdout) == ["1"]
