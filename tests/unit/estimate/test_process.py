"""The rank process around the tensors: the measured runtime (cached), the data pipeline, gloo's collective
temporaries, the ZeRO-3 norm workspace, and what offload saves when host RAM is the device's memory."""
from __future__ import annotations

import json
import subprocess

import pytest

from dsrun.offload.nvme import NORM_CHUNK

from dsrun.estimate import BufferSettings, EstimateInputs, estimate_peak_bytes_per_rank
from dsrun.estimate.buffers import buffer_bytes
from dsrun.estimate.model_states import model_state_bytes
from dsrun.estimate.runspec import data_pipeline_bytes
from dsrun.estimate.runtime import RankRuntime, measure_rank_runtime, runtime_cache_path, tiny_model_config

P = 10_000_000


def spec(**kw) -> EstimateInputs:
    base = dict(total_params=P, largest_layer_params=1_000_000, ranks_per_node=4, precision="fp32",
                optimizer="AdamW", device="cpu")
    base.update(kw)
    return EstimateInputs(**base)


def test_the_runtime_probe_result_is_cached_per_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("DSRUN_CACHE_DIR", str(tmp_path))
    gpt = {"_target_": "dsrun.models.gpt.GPT", "n_layer": 12, "n_embd": 768, "n_head": 12, "block_size": 1024,
           "vocab_size": 50304}
    path = runtime_cache_path(2, "AdamW", gpt, "bf16")
    assert path.parent == tmp_path / "estimate"
    # other threads, optimizer, precision or model class: another entry; another width of the same class: the same
    assert path != runtime_cache_path(1, "AdamW", gpt, "bf16") != runtime_cache_path(2, "Lion", gpt, "bf16")
    assert path != runtime_cache_path(2, "AdamW", gpt, "fp32")
    assert path == runtime_cache_path(2, "AdamW", {**gpt, "n_layer": 48, "n_embd": 1600}, "bf16")
    cached = RankRuntime(resident=321 * 2**20, peak=322 * 2**20, threads=2, optimizer="AdamW", torch="x",
                         python="y", host="z")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(cached.__dict__))

    def no_subprocess(*args, **kwargs):
        raise AssertionError("a cached result must not start the probe")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    assert measure_rank_runtime(2, "AdamW", gpt, "bf16") == cached
    assert cached.age_text() == "cached, age unknown"  # an entry from before measured_at was recorded
    with pytest.raises(AssertionError, match="must not start"):  # refresh (--measure, --refresh-runtime) probes
        measure_rank_runtime(2, "AdamW", gpt, "bf16", refresh=True)
    aged = RankRuntime(**{**cached.__dict__, "measured_at": 1_000_000.0})
    assert aged.age_text(now=1_000_000.0 + 5 * 3600 + 60) == "measured 5 h ago"
    assert aged.age_text(now=1_000_010.0) == "measured just now"


def test_the_probe_runs_the_recipes_model_class_at_a_tiny_size():
    gpt = {"_target_": "dsrun.models.gpt.GPT", "n_layer": 12, "n_embd": 768, "n_head": 12, "block_size": 1024,
           "vocab_size": 256, "positions": "rotary"}
    tiny = tiny_model_config(gpt)
    assert tiny == {**gpt, "n_layer": 1, "n_embd": 64, "n_head": 4, "block_size": 16}
    assert tiny_model_config({"_target_": "my.Model", "width": 3}) == {}  # not GPT-shaped: the MLP probe
    assert tiny_model_config(None) == {}


@pytest.mark.slow
def test_the_probe_measures_an_idle_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("DSRUN_CACHE_DIR", str(tmp_path))
    runtime = measure_rank_runtime(1, "AdamW", None, "fp32", monitors=["csv_monitor", "mlflow"])
    # torch alone is ~200 MiB resident; its optimizer machinery adds ~70 MiB
    assert 200 * 2**20 < runtime.resident < 1024 * 2**20 and runtime.peak >= runtime.resident
    # rank 0's MLflow client and its SQLite store (SQLAlchemy, Alembic): ~160 MiB here, never a few MiB
    assert 50 * 2**20 < runtime.monitors < 1024 * 2**20
    assert list((tmp_path / "estimate").glob("rank-runtime-*.json"))


def test_data_pipeline_is_the_mapped_token_array(tmp_path):
    assert data_pipeline_bytes({"_target_": "dsrun.data.pystdlib.pystdlib_corpus", "max_bytes": 4_000_000})[0] \
        == 8_000_000  # uint16 tokens
    tokens = tmp_path / "train.bin"
    tokens.write_bytes(b"\0" * 1234)
    assert data_pipeline_bytes({"_target_": "dsrun.data.files.token_corpus", "path": str(tokens)})[0] == 1234
    assert data_pipeline_bytes({"_target_": "some.other.corpus"}) == (0, "unknown")


def test_the_rank_peak_on_the_cpu_is_the_whole_process():
    b = estimate_peak_bytes_per_rank(spec(rank_runtime_bytes=300 * 2**20, data_bytes=8 * 2**20))
    assert b.ranks_on_cpu and b.host_per_rank == 308 * 2**20
    assert b.rank_peak == b.peak_per_rank + b.host_per_rank
    on_cuda = estimate_peak_bytes_per_rank(spec(device="cuda", rank_runtime_bytes=300 * 2**20))
    assert on_cuda.rank_peak == on_cuda.peak_per_rank  # device memory; the process is host RAM


def test_gloo_collectives_copy_their_data_nccl_does_not():
    # stage 2, one bucket (5e8 > 1e7): the reduce-scatter copies all but this rank's piece; the all-gather
    # after the step copies the whole model
    cpu, cuda = buffer_bytes(spec(zero_stage=2)), buffer_bytes(spec(zero_stage=2, device="cuda"))
    assert cpu.collective_end == P * 4 * 3 // 4 and cpu.collective_publish == P * 4
    assert cuda.collective_end == cuda.collective_publish == 0
    assert buffer_bytes(spec(zero_stage=0)).collective_end == 0  # all-reduce works in place
    no_rs = buffer_bytes(spec(zero_stage=2, buffers=BufferSettings(reduce_scatter=False)))
    assert no_rs.collective_end == 0
    one_rank = buffer_bytes(spec(zero_stage=2, ranks_per_node=1))
    assert one_rank.collective_end == one_rank.collective_publish == 0  # nothing to exchange
    z3 = buffer_bytes(spec(zero_stage=3))
    assert z3.collective_backward == 1_000_000 * 4 and z3.collective_end == P * 4


def test_sixteen_bit_stage2_accumulates_through_an_fp32_copy_and_casts_before_gathering():
    b = buffer_bytes(spec(zero_stage=2, precision="bf16", device="cuda"))
    assert b.collective_end == P // 4 * 4  # the received piece in fp32
    assert b.collective_publish == P // 4 * 2  # the partition cast to bf16
    assert buffer_bytes(spec(zero_stage=2, device="cuda")).collective_end == 0  # fp32 adds in place


def test_zero3_gradient_clipping_norm_goes_through_float64():
    plain = model_state_bytes(spec(zero_stage=3, gradient_clipping=0.0))
    clipped = model_state_bytes(spec(zero_stage=3))  # DeepSpeed's default clips at 1.0
    assert plain.device_step_workspace == 0  # the fused CPU Adam needs no temporary
    assert clipped.device_step_workspace == 16 * min(P // 4, NORM_CHUNK)  # a float64 chunk and its square
    b = estimate_peak_bytes_per_rank(spec(zero_stage=3, ranks_per_node=1, gradient_clipping=1.0))
    assert b.optimizer_workspace == 16 * NORM_CHUNK  # the whole 10M partition would be 160 MB, then the peak
    # a world of one keeps ZeRO-3 parameters whole: no reduce bucket at the end of backward, the step is the peak
    assert b.peak_phase == "optimizer step"


def test_offload_on_a_cpu_host_moves_bytes_nvme_saves_them():
    none = estimate_peak_bytes_per_rank(spec(zero_stage=3))
    cpu = estimate_peak_bytes_per_rank(spec(zero_stage=3, offload_optimizer="cpu"))
    nvme = estimate_peak_bytes_per_rank(spec(zero_stage=3, offload_optimizer="nvme",
                                            buffers=BufferSettings(sub_group_size=100_000)))
    assert cpu.peak_per_rank < none.peak_per_rank  # off the "device"...
    assert cpu.rank_peak >= none.rank_peak  # ...but the same RAM on a CPU host: nothing saved
    assert nvme.rank_peak < none.rank_peak  # files: master, states and gradients leave RAM
    assert nvme.nvme_per_rank == (P // 4) * (4 + 8 + 4)
    assert nvme.offloaded == 4 * 100_000 * 4  # only the swap buffers stay
