"""`dsrun train` with compression recipes, `dsrun export`, and loading the export back."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.e2e.test_train import SHORT, train
from tests.helpers import run_cli

pytestmark = pytest.mark.slow


def test_gpt_qat_run_exports_packed_and_reloads(tmp_path):
    from dsrun.compression.export import load_compressed

    _, run_dir = train(tmp_path / "qat", "+recipe=gpt_qat", *SHORT, "train.save_interval=3",
                       "ds.compression_training.weight_quantization.shared_parameters.schedule_offset=0",
                       "ds.compression_training.weight_quantization.different_groups.wq1.params.start_bits=4")
    out = tmp_path / "int4"
    done = run_cli("export", "--compressed", str(run_dir), str(out))
    assert done.returncode == 0, done.stderr
    assert "parameters" in done.stdout and "x) in" in done.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tensors"]["transformer.h.0.attn.c_attn.weight"]["bits"] == 4
    model = load_compressed(out)
    assert model(torch.randint(0, 256, (1, 16))).shape == (1, 16, 256)
    w8a8 = run_cli("export", "--w8a8", "--groups", "4", str(run_dir), str(tmp_path / "w8a8"))
    assert w8a8.returncode == 0, w8a8.stderr
    assert json.loads((tmp_path / "w8a8" / "manifest.json").read_text())["activation_quantization"]


def test_export_errors_are_one_line(tmp_path):
    done = run_cli("export", str(tmp_path), str(tmp_path / "out"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "has no resolved.yaml" in done.stderr


def test_gpt_xtc_student_learns_from_a_teacher_run(tmp_path):
    _, teacher_dir = train(tmp_path / "teacher", "model.n_layer=6", *SHORT, "train.save_interval=3")
    refused = run_cli("train", "--dry-run", "+recipe=gpt_xtc", cwd=tmp_path)
    assert refused.returncode == 2 and "train.teacher" in refused.stderr
    metrics, run_dir = train(tmp_path / "student", "+recipe=gpt_xtc", f"train.teacher={teacher_dir}", *SHORT,
                             "train.save_interval=3")
    assert metrics["num_params"] < 0.6 * json.loads((teacher_dir / "metrics.json").read_text())["num_params"]
    done = run_cli("export", str(run_dir), str(tmp_path / "xtc"))
    assert done.returncode == 0, done.stderr
    manifest = json.loads((Path(tmp_path) / "xtc" / "manifest.json").read_text())
    assert manifest["tensors"]["transformer.h.2.mlp.c_fc.weight"]["bits"] == 1
    assert manifest["builder"]["n_layer"] == 3
