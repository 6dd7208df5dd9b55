"""The per-rank peak, the stage x offload grid, the verdict and the predicted-vs-measured comparison."""
from __future__ import annotations

import json
from unittest import mock

import pytest

from dsrun.estimate import BufferSettings, EstimateInputs, GPTShape, estimate_peak_bytes_per_rank
from dsrun.estimate.activations import gpt_activation_bytes
from dsrun.estimate.buffers import buffer_bytes
from dsrun.estimate.measure import comparison_table, compare_peaks, load_measured_peaks, worst_error_pct
from dsrun.estimate.model_states import model_state_bytes
from dsrun.estimate.peak import ZERO_OPTIONS, estimate_zero_options
from dsrun.estimate.report import build_report, compact_bytes, format_bytes
from dsrun.estimate.verdict import MemoryBudget, judge
from dsrun.utils.errors import UserError
from dsrun.zero.linear import _original_linear

GIB = 2**30
SHAPE = GPTShape(n_layer=24, n_embd=1024, n_head=16, vocab_size=50304)


def spec(**kw) -> EstimateInputs:
    base = dict(total_params=350_000_000, largest_layer_params=51_000_000, ranks_per_node=4, precision="bf16",
                optimizer="AdamW", micro_batch_size=4, seq_len=1024, model_shape=SHAPE)
    base.update(kw)
    return EstimateInputs(**base)


def test_peak_is_resident_states_plus_the_larger_phase():
    s = spec(zero_stage=2)
    b = estimate_peak_bytes_per_rank(s)
    acts = gpt_activation_bytes(SHAPE, 4, 1024, "bf16", False).total
    buffers = buffer_bytes(s)
    assert b.activations == acts
    states = model_state_bytes(s)
    assert states.device_step_workspace == 4 * 350_000_000 // 4  # Adam's fp32 temporary of the partition
    assert b.peak_per_rank == states.device_total + max(acts + buffers.backward, states.device_step_workspace)
    assert b.peak_phase == "forward/backward"
    assert b.model_states == states.device_total


def test_without_activations_the_optimizer_step_is_the_peak():
    b = estimate_peak_bytes_per_rank(spec(zero_stage=0, ranks_per_node=1, model_shape=None))
    assert b.peak_phase == "optimizer step" and b.optimizer_workspace == 4 * 350_000_000
    assert b.peak_per_rank == b.model_states + b.optimizer_workspace


def test_runtime_overhead_is_added_to_the_peak():
    base = estimate_peak_bytes_per_rank(spec())
    with_runtime = estimate_peak_bytes_per_rank(spec(runtime_overhead_bytes=GIB))
    assert with_runtime.peak_per_rank - base.peak_per_rank == GIB


def test_higher_stages_need_less_per_rank_and_checkpointing_less_still():
    same_buffers = BufferSettings(overlap_comm=False, reduce_bucket_size=20_000_000)
    peaks = [estimate_peak_bytes_per_rank(spec(zero_stage=st, buffers=same_buffers)).peak_per_rank
             for st in range(4)]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4
    ckpt = estimate_peak_bytes_per_rank(spec(zero_stage=3, buffers=same_buffers, activation_checkpointing=True))
    assert ckpt.peak_per_rank < peaks[3]


def test_stage3_reduction_peaks_after_the_activations_are_gone():
    with_acts = estimate_peak_bytes_per_rank(spec(zero_stage=3))
    assert with_acts.peak_phase == "forward/backward"
    no_acts = estimate_peak_bytes_per_rank(spec(zero_stage=3, model_shape=None))
    buffers = buffer_bytes(spec(zero_stage=3, model_shape=None))
    assert no_acts.peak_phase == "end of backward"
    assert no_acts.buffers == buffers.reduce_transient  # gathered parameters were released after their gradients
    assert no_acts.peak_per_rank == no_acts.model_states + no_acts.buffers


def test_unknown_model_shape_is_reported_not_guessed():
    b = estimate_peak_bytes_per_rank(spec(model_shape=None))
    assert b.activations == 0 and "activations not estimated" in b.notes[0]


def test_per_host_figures_scale_with_ranks_per_node():
    b = estimate_peak_bytes_per_rank(spec(zero_stage=3, offload_optimizer="cpu", ranks_per_node=8))
    assert b.peak_per_host == 8 * b.peak_per_rank
    assert b.host_per_host == 8 * max(b.host_per_rank, b.init_per_rank)
    json.dumps(b.to_dict())  # machine-readable as is


def test_option_grid_covers_every_supported_combination():
    rows = estimate_zero_options(spec())
    assert [(r.zero_stage, r.offload_optimizer, r.offload_param) for r in rows] == list(ZERO_OPTIONS)
    assert len(rows) == 12
    for row in rows:
        assert row.with_checkpointing.activations < row.without_checkpointing.activations
    stage3 = {(r.offload_optimizer, r.offload_param): r.without_checkpointing for r in rows if r.zero_stage == 3}
    assert stage3[("cpu", "cpu")].peak_per_rank < stage3[("cpu", "none")].peak_per_rank < \
        stage3[("none", "none")].peak_per_rank
    assert stage3[("nvme", "nvme")].nvme_per_rank > 0 and stage3[("none", "none")].nvme_per_rank == 0


def test_verdict_on_cpu_counts_every_rank_of_the_host():
    b = estimate_peak_bytes_per_rank(spec(zero_stage=0))
    need = 4 * max(b.peak_per_rank + b.host_per_rank, b.init_per_rank)
    assert judge(b, MemoryBudget(host_total=10 * need, host_available=10 * need)).level == "fits"
    assert judge(b, MemoryBudget(host_total=need, host_available=need // 2)).level == "tight"
    verdict = judge(b, MemoryBudget(host_total=need // 2, host_available=need // 2))
    assert verdict.level == "too big" and verdict.host_need == need and "on the CPU" in verdict.reason


def test_verdict_with_a_device_checks_each_rank_against_one_device():
    b = estimate_peak_bytes_per_rank(spec(zero_stage=3))
    roomy_host = MemoryBudget(host_total=1000 * GIB, host_available=1000 * GIB, device_total=80 * GIB,
                              device_name="H100")
    assert judge(b, roomy_host).level == "fits"
    small_device = MemoryBudget(1000 * GIB, 1000 * GIB, device_total=b.peak_per_rank // 2, device_name="T4")
    verdict = judge(b, small_device)
    assert verdict.level == "too big" and "T4" in verdict.reason and verdict.device_need == b.peak_per_rank


def test_report_json_carries_tables_options_and_verdict():
    report = build_report(spec(zero_stage=3), {"name": "gpt"}, {"zero_stage": "ds.zero_optimization.stage"},
                          MemoryBudget(64 * GIB, 60 * GIB))
    data = json.loads(report.to_json())
    assert data["deepspeed"]["zero3"].startswith("Estimated memory needed")
    assert len(data["options"]) == 12 and data["options"][0]["verdict"] in ("fits", "tight", "too big")
    assert data["recipe"]["peak_per_rank"] == estimate_peak_bytes_per_rank(spec(zero_stage=3)).peak_per_rank
    assert data["sources"]["zero_stage"] == "ds.zero_optimization.stage"


def test_byte_formatting():
    assert format_bytes(512) == "512 B" and format_bytes(1.5 * GIB) == "1.50 GiB"
    assert compact_bytes(0) == "0" and compact_bytes(95.4 * 2**20) == "95.4M" and compact_bytes(16 * GIB) == "16.00G"


def test_predicted_vs_measured_rows_and_errors():
    rows = compare_peaks(1100, {1: 1000, 0: 1250}, case="zero2-2ranks")
    assert [(r.rank, round(r.error_pct, 2)) for r in rows] == [(0, -12.0), (1, 10.0)]
    assert all(r.within(15) for r in rows) and not rows[0].within(10)
    assert worst_error_pct(rows) == pytest.approx(12.0)
    per_rank = compare_peaks({0: 1000, 1: 2000}, {0: 1000, 1: 1000})
    assert [r.error_pct for r in per_rank] == [0.0, 100.0]


def test_comparison_table_shows_error_and_tolerance():
    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(comparison_table(compare_peaks(2 * GIB, {0: GIB}, case="z3"), tolerance_pct=15))
    text = console.export_text()
    assert "+100.0%" in text and "no" in text and "2.00 GiB" in text and "tolerance 15%" in text


def test_load_measured_peaks_accepts_a_dict_or_a_list(tmp_path):
    path = tmp_path / "peaks.json"
    path.write_text(json.dumps({"peak_bytes_per_rank": {"0": 10, "1": 20}}))
    assert load_measured_peaks(path) == {0: 10, 1: 20}
    assert load_measured_peaks({"peak_bytes_per_rank": [5, 6]}) == {0: 5, 1: 6}
    path.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_measured_peaks(path)
    with pytest.raises(UserError, match="peak_bytes_per_rank"):
        load_measured_peaks({"peaks": [1]})
    with pytest.raises(UserError, match="file not found"):
        load_measured_peaks(tmp_path / "missing.json")


def test_a_rank_records_its_whole_peak_and_where_it_started(tmp_path):
    # A fresh process, as a rank is: 256 MiB of touched tensor memory must show up as about 256 MiB above
    # the start, and the recorded peak is the whole process's (start included).
    import subprocess
    import sys

    from tests.helpers import REPO

    script = ("import sys, torch\n"
              "from dsrun.estimate.measure import current_rss, record_rank_peak\n"
              "baseline = current_rss()\n"
              "t = torch.ones(64 * 2**20)\n"
              "del t\n"
              "record_rank_peak(sys.argv[1], 3, baseline)\n")
    env = {"PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1",
           "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, check=True, timeout=120, cwd=REPO)
    peaks = load_measured_peaks(tmp_path)
    assert list(peaks) == [3]
    record = json.loads((tmp_path / "memory_peak_rank3.json").read_text())
    assert record["device"] == "cpu" and record["peak_bytes"] == peaks[3]
    above = peaks[3] - record["start_bytes"]
    assert 250 * 2**20 <= above <= 300 * 2**20, above / 2**20
    assert record["start_bytes"] > 100 * 2**20  # torch is imported: the start is not zero, and it counts


def test_a_rank_does_not_inherit_its_parents_peak(tmp_path):
    # ru_maxrss survives fork + exec: a rank started by a big parent (the launcher's agent, or pytest) would
    # report the parent's peak. The measured peak must be the rank's own.
    import subprocess
    import sys

    from tests.helpers import REPO

    child = ("import sys, torch\n"
             "from dsrun.estimate.measure import current_rss, record_rank_peak\n"
             "baseline = current_rss()\n"
             "t = torch.ones(16 * 2**20)\n"
             "del t\n"
             "record_rank_peak(sys.argv[1], 0, baseline)\n")
    parent = ("import subprocess, sys\n"
              "ballast = bytearray(768 * 2**20)\n"  # the parent's peak: 768 MiB, touched
              "subprocess.run([sys.executable, '-c', sys.argv[1], sys.argv[2]], check=True, close_fds=True)\n")
    env = {"PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1",
           "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", parent, child, str(tmp_path)], env=env, check=True, timeout=120,
                   cwd=REPO)
    record = json.loads((tmp_path / "memory_peak_rank0.json").read_text())
    above = record["peak_bytes"] - record["start_bytes"]
    assert 60 * 2**20 <= above <= 100 * 2**20, above / 2**20  # the child's 64 MiB tensor, not 768 MiB
    assert record["peak_bytes"] < 700 * 2**20  # torch's libraries, not the parent's 768 MiB


def test_a_tied_embedding_holds_three_gradients_at_the_end_of_backward():
    """The head's weight gradient lives from the first backward op to the embedding's; autograd then sums the
    two into a third tensor. Counted here from torch's own allocation events on a tiny tied GPT whose
    vocabulary dominates (so nothing else of that size is live), and placed by the estimator as its own phase."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from dsrun.models.gpt import GPT

    vocab, width = 8192, 64
    torch.manual_seed(0)
    model = GPT(vocab_size=vocab, block_size=8, n_layer=1, n_head=2, n_embd=width, tie_embeddings=True)
    idx = torch.randint(0, vocab, (1, 8))
    grad = vocab * width * 4  # one fp32 vocab x width tensor
    # torch's own F.linear: an earlier ZeRO-3 engine or zero.Init in this process installs DeepSpeed's memory-
    # efficient linear for the rest of it (as DeepSpeed does), whose backward holds one gradient fewer here
    with mock.patch.object(torch.nn.functional, "linear", _original_linear):
        loss = model(idx, idx)
        loss = loss[1] if isinstance(loss, tuple) else loss
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss.backward()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak_large = 0
    for e in events:  # the largest number of gradient-sized tensors alive at once
        if e.nbytes() == grad:
            live += 1
        elif e.nbytes() == -grad:
            live -= 1
        peak_large = max(peak_large, live)
    assert peak_large == 3
    shape = GPTShape(n_layer=1, n_embd=width, n_head=2, vocab_size=vocab, tied_embeddings=True)
    s = spec(zero_stage=2, precision="fp32", model_shape=shape, micro_batch_size=1, seq_len=8,
             total_params=sum(p.numel() for p in model.parameters()), largest_layer_params=vocab * width)
    b = estimate_peak_bytes_per_rank(s)
    assert b.tied_gradients == 3 * grad
    assert b.peak_phase == "tied embedding backward"  # the vocabulary dominates this model
    untied = estimate_peak_bytes_per_rank(s.with_(model_shape=GPTShape(n_layer=1, n_embd=width, n_head=2,
                                                                       vocab_size=vocab)))
    assert untied.tied_gradients == 0 and untied.peak_phase != "tied embedding backward"


def test_rank_zero_alone_pays_for_the_monitors():
    s = spec(zero_stage=2, device="cpu", rank_runtime_bytes=400 * 2**20, monitor_bytes=160 * 2**20)
    with_monitors = estimate_peak_bytes_per_rank(s)
    without = estimate_peak_bytes_per_rank(s.with_(monitor_bytes=0))
    assert with_monitors.monitors == 160 * 2**20
    assert with_monitors.rank_peak == without.rank_peak + 160 * 2**20
    assert with_monitors.rank_peak_without_monitors == without.rank_peak
