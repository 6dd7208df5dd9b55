"""RunSpec validation: every problem of every section, one line each with its key path."""
import pytest

from dsrun.compose import compose_runspec
from dsrun.runspec import resolve_run
from dsrun.utils.errors import ConfigError


def problems(overrides):
    with pytest.raises(ConfigError) as info:
        resolve_run(compose_runspec(overrides))
    return [str(p) for p in info.value.problems]


def test_valid_default_resolves_batch_for_world_size():
    run = resolve_run(compose_runspec(["launcher.num_procs=3", "ds.train_micro_batch_size_per_gpu=4",
                                       "ds.gradient_accumulation_steps=2"]))
    assert run.world_size == 3
    assert run.ds.train_batch_size == 24
    assert run.ds_dict()["train_batch_size"] == 24


def test_problems_from_several_sections_reported_together():
    found = problems(["train.max_steps=0", "launcher.num_procs=0", "ds.zero_optimization.stage=7"])
    assert any(p.startswith("train.max_steps:") for p in found)
    assert any(p.startswith("launcher.num_procs:") for p in found)
    assert any(p.startswith("ds.zero_optimization.stage:") for p in found)


def test_unknown_key_in_train_suggests():
    found = problems(["+train.max_stpes=3"])
    assert found == ["train.max_stpes: unknown key 'max_stpes' (value 3) (did you mean 'max_steps'?)"]


def test_inconsistent_batch_explains_arithmetic():
    found = problems(["+ds.train_batch_size=30", "ds.train_micro_batch_size_per_gpu=4",
                      "ds.gradient_accumulation_steps=2", "launcher.num_procs=2"])
    text = "\n".join(found)
    assert "train_batch_size" in text and "30" in text and "launcher.num_procs=2" in text


def test_launcher_problems_name_runspec_keys():
    found = problems(["launcher.num_procs=0", "+launcher.num_prcs=2"])
    assert any(p.startswith("launcher.num_procs") for p in found), found
    assert any(p.startswith("launcher.num_prcs") and "num_procs" in p for p in found), found


def test_world_size_from_a_hostfile(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two hosts\nnode-a slots=2\n\nnode-b slots=2\n")
    run = resolve_run(compose_runspec(["launcher=ssh", f"launcher.hostfile={hostfile}",
                                       "ds.train_micro_batch_size_per_gpu=2"]))
    assert run.world_size == 4 and run.ds.train_batch_size == 8
    assert "hostfile" in run.world_size_source and "2 + 2 slots" in run.world_size_source


def test_sequence_parallel_needs_both_the_groups_and_the_model():
    run = resolve_run(compose_runspec(["+recipe=gpt_ulysses", "launcher.num_procs=4"]))
    assert run.ds.sequence_parallel_size == 2 and run.ds.train_batch_size == 4 * 2  # 4 ranks / sp 2 replicas
    assert problems(["+recipe=gpt_ulysses", "model.sequence_parallel=false"])[0].startswith(
        "model.sequence_parallel: is off, but ds.sequence_parallel_size=2")
    assert problems(["model.sequence_parallel=true"])[0].startswith(
        "model.sequence_parallel: is on, but ds.sequence_parallel_size is 1")
