"""Exact resume on 2 ranks: 20 uninterrupted steps vs 10 steps, save, and a new launch that loads and runs 10
more, for ZeRO stages 0-3 in fp32 and bf16. The losses must be identical bit for bit (dropout is on, so the
RNG states matter), as must the final parameters; zero_to_fp32 on a checkpoint must equal the live model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dsrun.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from tests.harness.checkpoints import CheckpointJob, run_jobs
from tests.harness.launch import Launch, Runs

STAGES = (0, 1, 2, 3)
COMBOS = [(stage, precision) for stage in STAGES for precision in ("fp32", "bf16")]


def collect(launch: Runs):
    """Uninterrupted runs and the saves halfway in one launch, then the resumed runs."""
    root = launch.root
    base = {(s, p): CheckpointJob(stage=s, precision=p, steps=20, global_batch=4) for s, p in COMBOS}
    first = list(base.values())
    first += [job.but(steps=10, save_at=(10,), save_dir=str(root / f"{s}{p}")) for (s, p), job in base.items()]
    uninterrupted_and_saved = launch(Launch(run_jobs, 2, (first,), timeout=400, rank=0))
    second = [job.but(steps=10, load=str(root / f"{s}{p}"), final_save=str(root / f"final{s}{p}"))
              for (s, p), job in base.items()]
    resumed = launch(Launch(run_jobs, 2, (second,), timeout=400, rank=0))
    return root, {combo: (uninterrupted_and_saved[i], resumed[i]) for i, combo in enumerate(COMBOS)}


@pytest.mark.slow
@pytest.mark.parametrize("stage,precision", COMBOS)
def test_resumed_run_is_bitwise_identical(runs, stage, precision):
    _, results = runs
    full, resumed = results[(stage, precision)]
    assert resumed["loaded_steps"] == 10 and resumed["loaded_stream"] == 10
    assert resumed["client"] == {"note": "hi"}
    assert resumed["losses"] == full["losses"][10:]  # exact float equality, every step
    assert resumed["global_steps"] == full["global_steps"] == 20
    assert resumed["lr"] == full["lr"]
    for key, value in full["params"].items():
        assert np.array_equal(resumed["params"][key], value), key


@pytest.mark.slow
@pytest.mark.parametrize("stage,precision", COMBOS)
def test_zero_to_fp32_matches_live_model_after_two_rank_training(runs, stage, precision):
    root, results = runs
    _, resumed = results[(stage, precision)]
    sd = get_fp32_state_dict_from_zero_checkpoint(str(root / f"final{stage}{precision}"))
    assert list(sd) == list(resumed["params"])
    assert sd["lm_head.weight"] is sd["transformer.wte.weight"]  # tied weights stay one tensor
    for key, live in resumed["params"].items():
        got = sd[key]
        if precision == "bf16":  # fp32 masters; the live bf16 model holds them rounded
            got = got.to(torch.bfloat16).float()
        assert np.array_equal(got.numpy(), live), key


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_to_fp32_holds_one_rank_file_at_a_time(runs, monkeypatch, stage):
    """Memory stays near the largest file plus the output: by the time a rank's optimizer file is read, the
    previous one's tensors (Adam moments included) and the model-states copy of the trained weights are gone."""
    import gc
    import weakref

    from dsrun.utils import zero_to_fp32 as z2f

    root, _ = runs
    real_load = z2f.load_file
    alive: list[weakref.ref] = []
    reads = []

    def tracking_load(path, index_only=False):
        gc.collect()
        reads.append((path, sum(ref() is not None for ref in alive)))
        obj = real_load(path, index_only)
        if path.endswith("optim_states.pt"):
            osd = obj["optimizer_state_dict"]
            base = osd.get("base_optimizer_state") or osd["optimizer_state_dict"]
            alive.extend(weakref.ref(t) for entry in base["state"].values() for t in entry.values()
                         if torch.is_tensor(t) and t.dim())
        elif "module" in obj:
            alive.extend(weakref.ref(obj["module"][name]) for shapes in obj["param_shapes"] for name in shapes
                         if obj["module"][name].numel())
        return obj

    monkeypatch.setattr(z2f, "load_file", tracking_load)
    z2f.get_fp32_state_dict_from_zero_checkpoint(str(root / f"final{stage}fp32"))
    optim_reads = [(p, n) for p, n in reads if p.endswith("optim_states.pt")]
    assert len(optim_reads) >= 3  # the header read, then one read per rank
    assert all(n == 0 for _, n in optim_reads[1:]), reads
