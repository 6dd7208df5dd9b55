"""The DeepSpeed config is parsed once per process: by ``dsrun train``'s launcher (``resolve_run`` twice, the
config once), by each rank (``load_resolved``, then ``zero.Init``, the pipelined GPT and ``dsrun.initialize``
reuse it), and by a script's own ``dsrun.initialize(config=...)``. Settings read outside ``dsrun.config`` come
from the typed sections (``ds_section``), with the schema's defaults."""
from __future__ import annotations

import copy

import pytest
import torch

import dsrun
from dsrun.config import ResolvedDsConfig, ds_section, load_resolved, parse_count

pytestmark = pytest.mark.usefixtures("world_of_one")

CONFIG = {"train_batch_size": 4, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1},
          "steps_per_print": 1000}


class _Parses:
    def __enter__(self) -> "_Parses":
        self.start = parse_count()
        return self

    def __exit__(self, *exc: object) -> None:
        self.count = parse_count() - self.start


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def test_a_script_s_initialize_parses_its_config_once() -> None:
    with _Parses() as parses:
        engine, *_ = dsrun.initialize(model=_model(), config=copy.deepcopy(CONFIG))
    assert parses.count == 1
    assert engine.train_micro_batch_size_per_gpu() == 2 and engine.zero_optimization_stage() == 1
    assert engine.config == CONFIG  # DeepSpeed's engine.config: the dict as given


def test_a_rank_parses_once_and_initialize_reuses_it() -> None:
    from dsrun.workloads.base import zero_init_context

    with _Parses() as parses:
        resolved = load_resolved(copy.deepcopy(CONFIG), world_size=1)
        with zero_init_context(resolved):
            model = _model()
        engine, *_ = dsrun.initialize(model=model, config=resolved)
    assert parses.count == 1
    assert engine._config is resolved.typed
    assert engine.config == CONFIG and isinstance(engine.config, dict)


def test_a_resolved_config_for_another_world_size_is_parsed_again() -> None:
    resolved = load_resolved(copy.deepcopy(CONFIG), world_size=2)  # e.g. an elastic job restarted smaller
    with _Parses() as parses:
        engine, *_ = dsrun.initialize(model=_model(), config=resolved)
    assert parses.count == 1
    assert engine.train_micro_batch_size_per_gpu() == 2 and engine.gradient_accumulation_steps() == 2
    assert engine._config is not resolved.typed


def test_the_launcher_resolves_the_ds_config_once() -> None:
    from dsrun.compose import compose_runspec
    from dsrun.runspec import resolve_run

    overrides = ["train.max_steps=2", "launcher.num_procs=2"]
    with _Parses() as parses:
        first = resolve_run(compose_runspec(overrides))
        again = resolve_run(compose_runspec(overrides), reuse=first)
    assert parses.count == 1 and again.ds is first.ds
    with _Parses() as parses:  # another world: parsed again
        other = resolve_run(compose_runspec(["train.max_steps=2", "launcher.num_procs=1"]), reuse=first)
    assert parses.count == 1 and other.ds is not first.ds


def test_a_pipelined_gpt_is_built_from_the_rank_s_parse() -> None:
    from dsrun.workloads.pipeline import build_pipeline_model

    spec = {"_target_": "dsrun.models.gpt.GPT", "n_layer": 2, "n_head": 2, "n_embd": 8, "block_size": 8,
            "vocab_size": 16, "pipeline_stages": 1}
    resolved = load_resolved({"train_micro_batch_size_per_gpu": 1}, world_size=1)
    with _Parses() as parses:
        build_pipeline_model(spec, resolved, 1)
    assert parses.count == 0


def test_a_resolved_config_copies_as_a_plain_dict_and_takes_changed_sections() -> None:
    resolved = load_resolved(copy.deepcopy(CONFIG), world_size=1)
    assert type(copy.deepcopy(resolved)) is dict and type(copy.copy(resolved)) is dict
    changed = {**copy.deepcopy(resolved), "zero_optimization": {"stage": 2}}
    with _Parses() as parses:
        updated = resolved.with_sections(changed)
    assert parses.count == 0 and isinstance(updated, ResolvedDsConfig)
    assert updated.typed.zero_optimization.stage == 2 and resolved.typed.zero_optimization.stage == 1
    assert updated.typed.train_micro_batch_size_per_gpu == 2 and dict(updated) == changed


def test_sections_of_a_raw_dict_take_the_schema_defaults_and_legacy_keys() -> None:
    zero = ds_section({}, "zero_optimization")
    # the defaults zero.Init's raw reads used: persistence threshold 1e5, MiCS off, no parameter offload
    assert zero.stage == 0 and zero.stage3_param_persistence_threshold == 100_000
    assert zero.mics_shard_size == -1 and zero.offload_param.device == "none"
    assert ds_section(None, "bf16").enabled is False
    assert ds_section({"bfloat16": {"enabled": True}}, "bf16").enabled is True  # migrated as a whole parse does
    assert ds_section({"zero_optimization": True}, "zero_optimization").stage == 1
    typed = load_resolved(copy.deepcopy(CONFIG), world_size=1)
    assert ds_section(typed, "zero_optimization") is typed.typed.zero_optimization
    assert ds_section(typed.typed, "zero_optimization") is typed.typed.zero_optimization


def test_zero_init_reads_the_typed_sections() -> None:
    init = dsrun.zero.Init(config_dict_or_path={"bfloat16": {"enabled": True},
                                                "zero_optimization": {"stage": 3,
                                                                      "stage3_param_persistence_threshold": 7}})
    assert init.dtype is torch.bfloat16 and init.persistence_threshold == 7
    default = dsrun.zero.Init()
    assert default.dtype is None and default.persistence_threshold == 100_000
    resolved = load_resolved({"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True},
                              "zero_optimization": {"stage": 3}}, world_size=1)
    with _Parses() as parses:
        assert dsrun.zero.Init(config=resolved).dtype is torch.float16
    assert parses.count == 0
