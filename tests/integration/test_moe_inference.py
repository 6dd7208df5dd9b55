"""MoE inference with expert parallelism on 2 gloo ranks: a ZeRO-2 training checkpoint of an expert-parallel
MoEGPT (one file per expert) served by ``init_inference(..., moe={"ep_size": 2})`` gives each rank's prompt the
logits the whole model gives it in one process, within the fp32 bound of ``tests/integration/_inference_models``
(and in float64); each rank keeps half the experts; the all-to-all bytes equal the analytic count; a ZeRO-3
MoE checkpoint loads the trained weights exactly (experts by global id) and serves spread as whole;
``dsrun generate``'s rank work on an MoE run greedily generates what the whole model generates."""
from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import run_ranks
from tests.integration import _moe_inference as w
from tests.integration._inference_models import fp32_bound

pytestmark = pytest.mark.slow  # one 2-rank launch that trains, saves and serves


def test_expert_parallel_inference_matches_the_whole_model(tmp_path) -> None:
    results = run_ranks(w.serve, 2, str(tmp_path / "ckpt"), timeout=300)
    for rank, result in enumerate(results):
        assert result["ep_size"] == 2
        assert result["kept"] == [w.EXPERTS // 2] * w.N_LAYER
        assert result["ids"] == [[2 * rank, 2 * rank + 1]] * w.N_LAYER
        for dtype, itemsize in (("float32", 4), ("float64", 8)):
            entry = {dtype: result[dtype], "sequential": 4 * w.N_LAYER + 1, "longest_sum": 4 * w.N_EMBD}
            bound = fp32_bound(entry, dtype)
            for how in ("spread", "built"):
                diff = np.abs(result[dtype][how] - result[dtype]["reference"]).max()
                assert diff <= bound, (rank, dtype, how, diff, bound)
            assert result[dtype]["a2a_bytes"] == w.analytic_a2a_bytes(itemsize)
        z3 = result["z3"]  # this rank's experts and every shared weight, as trained at ZeRO-3
        assert z3["weights"] == 0.0 and z3["expert_ids"] == [2 * rank, 2 * rank + 1]
        entry = {"float32": z3, "sequential": 4 * w.N_LAYER + 1, "longest_sum": 4 * w.N_EMBD}
        assert np.abs(z3["spread"] - z3["reference"]).max() <= fp32_bound(entry, "float32")
        generated = result["generate"]  # dsrun generate's rank work on an MoE run: EP over both ranks
        assert generated["ep_size"] == 2 and generated["completion"] == generated["whole"]
        assert "launcher.num_procs: 3 ranks do not divide the model's [4] experts" in generated["refused_3"]
    assert not np.array_equal(results[0]["float32"]["reference"], results[1]["float32"]["reference"])
