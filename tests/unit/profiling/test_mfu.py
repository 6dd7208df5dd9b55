"""Model FLOPs utilisation: PaLM's formula on a known GPT (numbers worked out by hand), the GPU peak table by
device name, the CPU matmul probe, the meter's arithmetic, and the engine's report for a user's script."""
from __future__ import annotations

import io
import math
from contextlib import redirect_stdout

import pytest
import torch

import dsrun
from dsrun.models import GPTConfig, forward_flops, matmul_parameters, model_step_flops, train_step_flops
from dsrun.monitor.progress import TrainingProgress, format_tflops
from dsrun.profiling.mfu import (DevicePeak, ModelFlopsMeter, device_peak, gpu_peak_tflops, measure_matmul_peak,
                                 train_flops_per_token)


def test_palm_formula_on_a_known_gpt():
    config = GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=128)
    # N: per block QKV 3d² + output d² + MLP 2·4d² = 12d², twice, plus the head vocab·d
    assert matmul_parameters(config) == 12 * 2 * 64 * 64 + 256 * 64 == 114_688
    # per token 6N + 12·L·d·T = 688,128 + 196,608; 4 samples x 128 tokens
    assert train_flops_per_token(114_688, 2, 64, 128) == 884_736
    assert model_step_flops(config, 4, 128) == 512 * 884_736 == 452_984_832
    assert model_step_flops(config, 4, 128) == 3 * forward_flops(config, 4, 128)
    # recompute is the hardware's work, not the model's: MFU's numerator ignores checkpointing
    checkpointed = GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=128,
                             activation_checkpointing="full")
    assert model_step_flops(checkpointed, 4, 128) == 452_984_832
    assert train_step_flops(checkpointed, 4, 128) > model_step_flops(checkpointed, 4, 128)


@pytest.mark.parametrize("name, dtype, tf32, expected", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, False, (989.4, "NVIDIA H100 SXM bf16 dense")),
    ("NVIDIA H100 PCIe", torch.float16, False, (756.5, "NVIDIA H100 PCIe fp16 dense")),
    ("NVIDIA H100 NVL", torch.bfloat16, False, (835.5, "NVIDIA H100 NVL bf16 dense")),
    ("NVIDIA H200", torch.bfloat16, False, (989.4, "NVIDIA H200 bf16 dense")),
    ("NVIDIA H200 NVL", torch.bfloat16, False, (835.5, "NVIDIA H200 NVL bf16 dense")),
    ("NVIDIA GH200 480GB", torch.bfloat16, False, (989.4, "NVIDIA GH200 bf16 dense")),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, False, (312.0, "NVIDIA A100 bf16 dense")),
    ("NVIDIA A100-PCIE-40GB", torch.float32, True, (156.0, "NVIDIA A100 tf32 dense")),
    ("NVIDIA A100-PCIE-40GB", torch.float32, False, (19.5, "NVIDIA A100 fp32")),
    ("NVIDIA H100 80GB HBM3", torch.float32, True, (494.7, "NVIDIA H100 SXM tf32 dense")),
])
def test_gpu_peak_table_by_device_name(name, dtype, tf32, expected):
    assert gpu_peak_tflops(name, dtype, tf32=tf32) == expected


def test_unknown_devices_and_dtypes_are_not_in_the_table():
    assert gpu_peak_tflops("NVIDIA GeForce RTX 4090", torch.bfloat16) is None
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3", torch.int8) is None


def test_cpu_probe_measures_a_positive_finite_rate():
    for dtype in (torch.float32, torch.bfloat16):
        rate = measure_matmul_peak(dtype, threads=1, sizes=(128, 256), budget_s=0.05)
        assert rate > 0 and math.isfinite(rate)
    peak = device_peak("cpu", torch.float32)  # no GPU: the probe, whatever the thread count
    assert peak.source == "measured" and peak.flops > 0 and math.isfinite(peak.flops)
    assert peak.line().startswith("peak (measured): ") and peak.line().endswith(" TFLOP/s")


def test_a_16_bit_peak_is_never_below_the_fp32_one(monkeypatch):
    """A CPU without fp16 arithmetic: its fp16 GEMM (~3 GFLOP/s here) is slower than the fp32 kernels a 16-bit
    model also runs, so the fp32 rate bounds the model's; a fast 16-bit GEMM (bf16 with AMX) keeps its own."""
    import dsrun.profiling.mfu as mfu

    rates = {torch.float32: 100e9, torch.float16: 3e9, torch.bfloat16: 180e9}
    monkeypatch.setattr(mfu, "measure_matmul_peak", lambda dtype, device, threads=None: rates[dtype])
    assert device_peak("cpu", torch.float16).flops == 100e9
    assert device_peak("cpu", torch.bfloat16).flops == 180e9
    assert device_peak("cpu", torch.float32).flops == 100e9


def test_meter_divides_by_devices_and_peak():
    meter = ModelFlopsMeter(flops_per_step=4e12, peak=DevicePeak(10e12, "given"), devices=2)
    rate = meter.rate(steps=5, elapsed_s=2.0)  # 20e12 FLOPs in 2 s over 2 devices: 5 TFLOP/s each
    assert rate.tflops_per_device == pytest.approx(5.0) and rate.mfu == pytest.approx(0.5)
    assert rate.text() == "5.00 TFLOP/s | MFU 50.0%"
    assert rate.events(64) == [("Train/Samples/tflops_per_device", rate.tflops_per_device, 64),
                               ("Train/Samples/mfu", rate.mfu, 64)]
    assert meter.rate(steps=1, elapsed_s=0.0) is None


def test_progress_line_carries_tflops_and_mfu():
    out = io.StringIO()
    progress = TrainingProgress(10, print_every=5, bar=False, stream=out)
    progress.update(5, 2.5, 1e-3, 100.0, 12_800.0, 1.0, tflops=0.0123, mfu=0.081)
    progress.update(10, 2.4, 1e-3, 100.0, 12_800.0, 2.0)  # FLOPs unknown: the line as before
    first, second = out.getvalue().splitlines()
    assert "| 12,800 tokens/s | 0.0123 TFLOP/s | MFU 8.1% | eta " in first
    assert "TFLOP/s" not in second and "MFU" not in second
    assert [format_tflops(x) for x in (0.021, 412.3, 989.4, 1979.0)] == ["0.0210", "412", "989", "1,979"]


@pytest.mark.usefixtures("world_of_one")
def test_user_script_engine_reports_mfu_on_its_step_line_and_monitors(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}}
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=config)
    out = io.StringIO()
    with redirect_stdout(out):
        # 6 FLOPs per weight per sample (the two Linears' 16·32 + 32·1 weights); a given peak: no probe
        assert engine.set_model_flops(6 * (16 * 32 + 32), peak_flops=1e9) == 1e9
        for _ in range(4):
            loss = torch.nn.functional.mse_loss(engine(torch.randn(4, 16)), torch.randn(4, 1))
            engine.backward(loss)
            engine.step()
    engine.monitor.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "[dsrun] peak (given): 0.00100 TFLOP/s"
    steps = [line for line in lines if line.startswith("[dsrun] step=")]
    assert len(steps) == 2 and all(" TFLOP/s | MFU " in line for line in steps)
    rows = (tmp_path / "job" / "Train_Samples_mfu.csv").read_text().splitlines()
    assert rows[0] == "step,mfu" and [int(r.split(",")[0]) for r in rows[1:]] == [8, 16]  # every 2 steps
    assert all(float(r.split(",")[1]) > 0 for r in rows[1:])
    assert (tmp_path / "job" / "Train_Samples_tflops_per_device.csv").exists()
