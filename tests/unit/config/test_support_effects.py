"""The support ledger's proof for keys read outside the engine: ``autotuning`` (read by ``dsrun tune``),
``elasticity`` (the config layer's batch arithmetic) and ``dsrun_allow_unimplemented``. Each
``test_key_changes_behaviour[KEY]`` case changes the key and sees what changes."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable

import pytest

from dsrun.autotuning import Tuner, build_space, profile_metrics, settings_from
from dsrun.autotuning.space import batch_size_bound, micro_batch_candidates
from dsrun.config import load_ds_config, validate_ds_config
from dsrun.config.misc import AutotuningConfig
from dsrun.utils.errors import ConfigError, UserError

EFFECTS: dict[str, Callable[..., None]] = {}


def effect(*keys: str) -> Callable:
    def register(fn: Callable) -> Callable:
        for key in keys:
            EFFECTS[key] = fn
        return fn
    return register


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.function.__name__ == "test_key_changes_behaviour":
        metafunc.parametrize("key", sorted(EFFECTS))


def test_key_changes_behaviour(key: str, tmp_path: Path, capsys) -> None:
    EFFECTS[key](key=key, tmp_path=tmp_path, capsys=capsys)


@effect("vocabulary_size")
def _vocabulary_size(**_):
    said = [[w for w in load_ds_config({"train_micro_batch_size_per_gpu": 1, "vocabulary_size": size}).warnings
             if "vocabulary_size" in w] for size in (50304, 50257)]
    assert said[0] == [] and said[1] == ["vocabulary_size 50257 is not a multiple of 8: embeddings and the output "
                                         "layer of that width use GPU tensor cores less well (pad the vocabulary to "
                                         "a multiple of 8)"]


# --- autotuning ------------------------------------------------------------------------------------------------------
SPACE = {"zero_optimization": {"stage": [0, 1]}, "train_micro_batch_size_per_gpu": [1, 2],
         "zero_optimization.overlap_comm": [True, False]}
RECIPE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}}


def tune_settings(tmp_path: Path, raw: dict | None = None, space: dict | None = None, **autotuning: Any) -> Any:
    return settings_from(AutotuningConfig(**autotuning), raw or {}, {"space": SPACE if space is None else space},
                         tmp_path)


@effect("autotuning.enabled")
def _enabled(tmp_path, **_):
    with pytest.raises(UserError, match="ds.autotuning.enabled"):
        tune_settings(tmp_path, raw={"enabled": False}, enabled=False)
    tune_settings(tmp_path, raw={"enabled": True}, enabled=True)


@effect("autotuning.fast")
def _fast(tmp_path, **_):
    dims = [list(build_space(tune_settings(tmp_path, fast=fast), RECIPE, world_size=2).dims) for fast in (True, False)]
    assert "zero_optimization.overlap_comm" not in dims[0] and "zero_optimization.overlap_comm" in dims[1]


@effect("autotuning.results_dir", "autotuning.exps_dir")
def _folders(key, tmp_path, **_):
    name = key.split(".")[1]
    assert getattr(tune_settings(tmp_path, **{name: "mine"}), name) == tmp_path / "mine"
    assert getattr(tune_settings(tmp_path), name) != tmp_path / "mine"


@effect("autotuning.overwrite")
def _overwrite(tmp_path, **_):
    # dsrun resumes a study unless overwrite is written: the section as the user wrote it decides
    assert tune_settings(tmp_path, raw={"overwrite": True}, overwrite=True).overwrite is True
    assert tune_settings(tmp_path).overwrite is False


@effect("autotuning.metric")
def _metric(tmp_path, **_):
    # the tuner keeps the better trial: lower latency, higher throughput
    assert tune_settings(tmp_path, metric="latency").better(1.0, 2.0)
    assert not tune_settings(tmp_path, metric="throughput").better(1.0, 2.0)


@effect("autotuning.start_profile_step", "autotuning.end_profile_step")
def _profile_window(key, tmp_path, **_):
    worker = {"step_times_ms": [50.0, 10.0, 20.0, 30.0, 40.0], "step_timers_ms": [None] * 5, "train_batch_size": 4,
              "world_size": 1}
    changed = {"start_profile_step": 3} if key.endswith("start_profile_step") else {"end_profile_step": 5}
    latencies = []
    for keys in ({}, changed):
        s = tune_settings(tmp_path, **{"start_profile_step": 2, "end_profile_step": 3, **keys})
        latencies.append(profile_metrics(worker, s.start_profile_step, s.end_profile_step)["latency"])
    assert latencies == [15.0, 20.0 if key.endswith("start_profile_step") else 25.0]  # medians of the window


@effect("autotuning.max_train_batch_size", "autotuning.max_train_micro_batch_size_per_gpu",
        "autotuning.min_train_micro_batch_size_per_gpu", "autotuning.num_tuning_micro_batch_sizes")
def _micro_batches(key, tmp_path, **_):
    name = key.split(".")[1]
    changed = {"max_train_batch_size": 8, "max_train_micro_batch_size_per_gpu": 2,
               "min_train_micro_batch_size_per_gpu": 2, "num_tuning_micro_batch_sizes": 2}[name]
    candidates = [micro_batch_candidates(tune_settings(tmp_path, **keys), accumulation=2, data_parallel_size=2)
                  for keys in ({}, {name: changed})]
    assert candidates[0] == [1, 2, 4] and candidates[1] != candidates[0]


@effect("autotuning.mp_size")
def _mp_size(tmp_path, **_):
    # DeepSpeed's autotuner: the data-parallel size is ranks / mp_size, so a trial's global batch is micro x
    # accumulation x (4 / 2) and the micro-batch bound is max_train_batch_size * mp_size // ranks (32 * 2 // 4)
    recipe = {**RECIPE, "gradient_accumulation_steps": 1, "tensor_parallel": {"autotp_size": 2}}
    space = {"zero_optimization": {"stage": [0, 1]}}
    spaces = [build_space(tune_settings(tmp_path, space=space, max_train_batch_size=32, num_tuning_micro_batch_sizes=6,
                                        mp_size=mp), cfg, 4, script=script)
              for mp, cfg, script in ((1, RECIPE, True), (2, recipe, False))]
    config = {"train_micro_batch_size_per_gpu": 4}
    assert [s.train_batch_size(config) for s in spaces] == [4 * 2 * 4, 4 * 1 * 2]
    assert [max(s.dims["train_micro_batch_size_per_gpu"]) for s in spaces] == [4, 16]  # 32 // (2 x 4); 32 * 2 // 4
    for mp, cfg, script, said in ((3, RECIPE, True, "must divide the 4 ranks"),
                                  (2, RECIPE, False, "set ds.tensor_parallel.autotp_size=2"),
                                  (1, recipe, False, "set autotuning.mp_size to 2")):
        with pytest.raises(UserError, match=said):
            build_space(tune_settings(tmp_path, space=space, mp_size=mp), cfg, 4, script=script)


@effect("autotuning.min_train_batch_size")
def _min_train_batch_size(tmp_path, **_):
    # the study prunes a configuration before launch with this reason (dsrun/autotuning/study.py)
    reasons = [[batch_size_bound(tune_settings(tmp_path, **keys), size) for size in (1, 4)]
               for keys in ({}, {"min_train_batch_size": 4})]
    assert reasons == [[None, None], ["train batch size 1 < min_train_batch_size 4", None]]


@effect("autotuning.arg_mappings")
def _arg_mappings(tmp_path, **_):
    s = tune_settings(tmp_path, arg_mappings={"train_micro_batch_size_per_gpu": "--batch"})
    space = build_space(s, RECIPE, world_size=2)
    config = space.config({"zero_optimization.stage": 1, "train_micro_batch_size_per_gpu": 2,
                           "zero_optimization.overlap_comm": True})
    assert "++batch=2" in space.overrides(config, s.arg_mappings) and "++batch=2" not in space.overrides(config, {})


@effect("autotuning.model_info.num_params")
def _model_info(tmp_path, **_):
    def compose(overrides: list[str]) -> Any:
        raise RuntimeError("a profiling run would start here")

    def tuner(**keys: Any) -> Tuner:
        s = tune_settings(tmp_path, results_dir=str(tmp_path / "r"), **keys)
        return Tuner(s, build_space(s, RECIPE, world_size=1), [], [], compose)

    assert tuner(model_info={"num_params": 1234}).model_info()["num_params"] == 1234  # nothing launched
    with pytest.raises(RuntimeError, match="profiling run"):
        tuner().model_info()


# --- elasticity: the batch sizes come from the elastic search --------------------------------------------------------
ELASTIC = {"enabled": True, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "version": 0.2,
           "num_gpus_per_node": 8}
SMALL_V01 = {"version": 0.1, "max_train_batch_size": 100, "micro_batch_sizes": [2, 3]}
ELASTIC_CHANGES = {  # key -> (base changes, changed) giving different batch triads at world size 8
    "enabled": ({"enabled": False}, {}),
    "max_train_batch_size": ({}, {"max_train_batch_size": 1000}),
    "micro_batch_sizes": ({}, {"micro_batch_sizes": [4]}),
    "min_gpus": ({}, {"min_gpus": 16}),
    "max_gpus": (SMALL_V01, {**SMALL_V01, "max_gpus": 10}),
    "prefer_larger_batch": ({"micro_batch_sizes": [3, 5]}, {"micro_batch_sizes": [3, 5], "prefer_larger_batch": False}),
    "version": ({}, {"version": 0.1}),
    "num_gpus_per_node": ({}, {"num_gpus_per_node": 1}),
    "model_parallel_size": ({"max_train_batch_size": 500}, {"max_train_batch_size": 500, "model_parallel_size": 2}),
}


def triad(elasticity: dict, **top: Any) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = load_ds_config({"elasticity": elasticity, **top}, world_size=8)
    except ConfigError as err:
        return str(err)
    return cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps


@effect(*[f"elasticity.{key}" for key in ELASTIC_CHANGES])
def _elasticity(key, **_):
    base, changed = ELASTIC_CHANGES[key.split(".")[1]]
    top = {"train_micro_batch_size_per_gpu": 2} if key == "elasticity.enabled" else {}
    assert triad({**ELASTIC, **base}, **top) != triad({**ELASTIC, **changed})


@effect("elasticity.ignore_non_elastic_batch_info")
def _ignore_batch_info(**_):
    assert "must not be given when elasticity is enabled" in triad(ELASTIC, train_batch_size=16)
    assert triad({**ELASTIC, "ignore_non_elastic_batch_info": True}, train_batch_size=16) == triad(ELASTIC)


# --- dsrun's own ---------------------------------------------------------------------------------------------------
@effect("dsrun_allow_unimplemented")
def _allow(capsys, **_):
    config = {"train_micro_batch_size_per_gpu": 1, "nebula": {"enabled": True}}
    assert [p.path for p in validate_ds_config(config)] == ["nebula.enabled"]
    cfg = load_ds_config({**config, "dsrun_allow_unimplemented": True})
    assert cfg.unimplemented == ["nebula.enabled"]
    assert cfg.unimplemented_warnings[0].startswith("warning: nebula.enabled: not implemented")
