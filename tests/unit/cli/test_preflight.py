"""dsrun train's checks before launch: unset values, memory, the warm-up note, monitor folders, the data's
digest."""
from types import SimpleNamespace

import numpy as np
import pytest
from omegaconf import OmegaConf

from dsrun.cli.preflight import (check_before_launch, data_digest, missing_values, monitor_path_problems,
                                 unwritable, warmup_note)
from dsrun.compose import compose_runspec
from dsrun.runspec import resolve_run
from dsrun.utils.errors import UserError

SMALL = "data.max_bytes=300000"


def resolved(*overrides):
    return resolve_run(compose_runspec([SMALL, *overrides]))


def test_every_unset_value_is_named():
    spec = compose_runspec(["data=text", "model.n_layer=???"])
    assert [p.path for p in missing_values(spec)] == ["data.path", "model.n_layer"]


def test_the_default_recipe_fits_and_a_13b_model_does_not_by_the_estimator(monkeypatch):
    from dsrun.estimate import verdict

    gib = 2**30  # the machine of the README (24 GiB), whatever machine runs the test
    monkeypatch.setattr(verdict, "detect_budget", lambda: verdict.MemoryBudget(24 * gib, 20 * gib))
    checked = check_before_launch(resolved())
    assert checked.memory.startswith("fits: 2 ranks on the CPU need")
    assert checked.data["how"] == "full" and len(checked.data["sha256"]) == 64
    with pytest.raises(UserError) as info:
        check_before_launch(resolved("model=gpt-13b"))
    (problem,) = info.value.problems
    assert problem.path == "memory" and "--skip-memory-check" in problem.hint
    assert check_before_launch(resolved("model=gpt-13b"), memory_check=False).memory is None


class NeedsRealTensors:
    """A user's model whose constructor cannot run on the meta device."""

    def __init__(self, **kwargs):
        raise ValueError("this model reads its weights from disk\nat construction")


def test_a_model_that_cannot_be_built_on_meta_is_a_note_naming_its_own_error():
    """Not hydra's wrapper cut at its first line ("Error in call to target ...:"), the constructor's error."""
    checked = check_before_launch(resolved(f"model._target_={__name__}.NeedsRealTensors"), memory_check=False)
    assert ("memory not checked: the model could not be built on the meta device (ValueError: this model reads "
            "its weights from disk at construction)") in checked.notes


def test_a_warm_up_longer_than_the_run_is_one_note():
    note = warmup_note(resolved("train.max_steps=5"))
    assert note == ("note: ds.scheduler.params.warmup_num_steps=30 is more than the 5 steps this run takes: the "
                    "learning rate never leaves WarmupCosineLR's warm-up")
    assert warmup_note(resolved("train.max_steps=30")) is None
    assert warmup_note(resolved("train.max_steps=5", "scheduler=none")) is None


def test_gpt_tune_trials_and_its_run_leave_warm_up():
    """A dsrun tune trial of gpt_tune runs end_profile_step steps; neither it nor the 20-step run stays in
    warm-up (each trial used to warn, twice per rank)."""
    recipe = resolve_run(compose_runspec(["+recipe=gpt_tune"]))
    assert warmup_note(recipe) is None
    steps = recipe.ds.autotuning.end_profile_step
    assert warmup_note(resolve_run(compose_runspec(["+recipe=gpt_tune", f"train.max_steps={steps}"]))) is None


def test_an_unwritable_monitor_folder_is_a_problem_before_launch(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert unwritable(tmp_path / "new" / "deeper") is None  # made when missing, below a writable folder
    assert unwritable(blocker / "tb") == f"{blocker} is a file"
    run = resolved("ds.tensorboard.enabled=true", f"ds.tensorboard.output_path={blocker / 'tb'}")
    (problem,) = monitor_path_problems(run.ds)
    assert problem.path == "ds.tensorboard.output_path" and "is a file" in problem.message


def test_the_data_digest_is_of_every_token_or_of_three_slices_past_the_limit():
    tokens = np.arange(10_000, dtype=np.uint16)
    corpus = SimpleNamespace(train_tokens=tokens[:9000], eval_tokens=tokens[9000:], description="t")
    full = data_digest(corpus)
    changed = tokens.copy()
    changed[4500] += 1
    other = SimpleNamespace(train_tokens=changed[:9000], eval_tokens=changed[9000:], description="t")
    assert full["how"] == "full" and full["bytes"] == 20_000
    assert data_digest(other)["sha256"] != full["sha256"]
    sampled = data_digest(corpus, limit=1000)
    assert sampled["how"] == "sampled" and sampled["sha256"] != full["sha256"]


def test_the_memory_line_says_what_it_counts_and_matches_estimate_memory_once_measured(monkeypatch, tmp_path):
    """gpt_zero3's dry run said 0.36 GiB, then 1.02 GiB once dsrun estimate-memory had measured an idle rank
    (its cached figure is added), with no word on the difference. Unmeasured, the line says it is a lower
    bound leaving the rank's process out; measured, it says it includes it and is estimate-memory's figure."""
    import json
    import re
    from dataclasses import asdict

    from dsrun.cli.estimate_memory import estimate_recipe
    from dsrun.estimate import verdict
    from dsrun.estimate.runtime import RankRuntime, enabled_monitors, rank_threads, runtime_cache_path

    gib = 2**30
    budget = verdict.MemoryBudget(24 * gib, 20 * gib)
    monkeypatch.setattr(verdict, "detect_budget", lambda: budget)
    monkeypatch.setenv("DSRUN_CACHE_DIR", str(tmp_path))  # no measurement yet
    run = resolved("+recipe=gpt_zero3")
    need = lambda memory: float(re.search(r"need ([\d.]+) GiB", memory).group(1))  # noqa: E731
    unmeasured = check_before_launch(run).memory
    assert "a lower bound" in unmeasured and "dsrun estimate-memory" in unmeasured, unmeasured

    resident = 300 * 2**20  # what estimate-memory's probe would have cached for this run's ranks
    path = runtime_cache_path(rank_threads(2), "AdamW", OmegaConf.to_container(run.runspec.model, resolve=True),
                              "fp32", enabled_monitors(OmegaConf.to_container(run.runspec.ds, resolve=True)))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(asdict(RankRuntime(resident, resident, rank_threads(2), "AdamW", "t", "p", "h"))))
    measured = check_before_launch(run).memory
    assert "a lower bound" not in measured and f"{resident / gib:.2f} GiB as dsrun estimate-memory measured" in measured
    # 2 ranks, each with its process added; figures printed to 0.01 GiB
    assert abs(need(measured) - need(unmeasured) - 2 * resident / gib) <= 0.01 + 1e-9
    # and it is the very figure estimate-memory's verdict prints for the same overrides
    assert verdict.judge(estimate_recipe([SMALL, "+recipe=gpt_zero3"]), budget).reason in measured
