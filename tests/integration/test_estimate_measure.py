"""``dsrun estimate-memory --measure`` acceptance: the GPT recipes at ZeRO stages 0-3 on 1, 2 and 4 CPU
ranks, and AutoTP's ``+recipe=gpt_tp`` (TP=2 x ZeRO-1, each rank holding half of every split matrix) on 2, each
rank's measured peak (its process's VmHWM) within 15% of the prediction.

Each case trains two real steps through ``dsrun.worker`` (see ``_estimate_cases``); the prediction is the
CLI's own (``estimate_recipe``), with the rank runtime its probe measures on this host. The table (also in
pytest's terminal summary) shows, per case, the predicted and measured peak, the error, the error of the
part above the measured rank runtime, and the shares of the peak that are model states and runtime: the
model is wide enough that model states are a real part of the peak, so an estimate cannot pass on the
runtime alone.
"""
from __future__ import annotations

import os

import pytest

from tests.integration._estimate_cases import EXTRA_CASES, RANKS, RECIPES, measure_cases, predict, prepare

TOLERANCE_PCT = 15.0
ABOVE_RUNTIME_TOLERANCE_PCT = 25.0  # the modelled part alone (model states, activations, buffers, data)
MIN_MODEL_STATE_SHARE_PCT = 8.0
MiB = 2**20
# ~150 s of CPU in all (measured 2026-12-07: the 30 ranks 135 s, 4.5 s each, mostly their imports; the probes
# 5 s), so about 75 s on 2 idle cores; 11 minutes at load average 15-20 on the shared development machine (before
# dsrun's optimizers stopped importing torch._dynamo: 188 s). On a loaded machine raise the limit:
# DSRUN_ESTIMATE_CASES_TIMEOUT=SECONDS.
CASES_TIMEOUT = float(os.environ.get("DSRUN_ESTIMATE_CASES_TIMEOUT", "560"))


@pytest.mark.slow
@pytest.mark.timeout(CASES_TIMEOUT + 40)
def test_predicted_peak_is_within_15_percent_for_stages_0_to_3_on_1_2_4_ranks(tmp_path, estimate_table_log,
                                                                              monkeypatch):
    # the rank runtime is probed now, as `--measure` does, not read from an earlier session's cache (the same
    # code on one host measured 616 and 639 MiB five hours apart)
    monkeypatch.setenv("DSRUN_CACHE_DIR", str(tmp_path / "cache"))
    cases = measure_cases([prepare(recipe, n, tmp_path) for n in RANKS for recipe in RECIPES]
                          + [prepare(recipe, n, tmp_path) for recipe, n in EXTRA_CASES], timeout=CASES_TIMEOUT)
    header = (f"{'case':<13} {'rank':>4} {'predicted':>10} {'measured':>10} {'error':>7} {'above-rt err':>12} "
              f"{'states':>7} {'runtime':>8}  peak phase")
    lines = [f"GPT 2 x 768 (14.4M params), micro batch 2 x 64, fp32 AdamW, 2 steps; MiB; "
             f"tolerance {TOLERANCE_PCT:g}%", header]
    failures = []
    for case in cases:
        estimate = predict(case)
        predicted, runtime = estimate.rank_peak, estimate.rank_runtime
        assert len(case.records) == case.world_size, case
        for record in case.records:
            measured = record["peak_bytes"]
            error = 100 * (predicted - measured) / measured
            above = 100 * ((predicted - runtime) - (measured - runtime)) / (measured - runtime)
            states_share = 100 * estimate.model_states / measured
            lines.append(f"{case.recipe + '-' + str(case.world_size):<13} {record['rank']:>4} "
                         f"{predicted / MiB:>10.1f} {measured / MiB:>10.1f} {error:>+6.1f}% {above:>+11.1f}% "
                         f"{states_share:>6.1f}% {100 * runtime / measured:>7.1f}%  {estimate.peak_phase}")
            if abs(error) > TOLERANCE_PCT:
                failures.append(f"{case.recipe} on {case.world_size} ranks, rank {record['rank']}: {error:+.1f}%")
            if abs(above) > ABOVE_RUNTIME_TOLERANCE_PCT:
                failures.append(f"{case.recipe} on {case.world_size} ranks, rank {record['rank']}: "
                                f"{above:+.1f}% above the runtime")
            if states_share < MIN_MODEL_STATE_SHARE_PCT:
                failures.append(f"{case.recipe} on {case.world_size} ranks: model states only "
                                f"{states_share:.1f}% of the peak; the case proves little")
    estimate_table_log.extend(lines)
    print("\n" + "\n".join(lines))
    assert not failures, "\n".join(failures)
