"""The support ledger stays honest: one entry per schema key, every implemented key names tests that exist
and change it (the tracer in tests/unit/runtime/test_config_reads.py checks the runtime reads it), few keys
without effect and each justified, and the generated table in docs/config_support.md is the ledger's.
Also the verdict itself: what is refused, what stays silent, what a warning downgrades."""
from __future__ import annotations

import ast
import copy
import importlib
import warnings
from pathlib import Path

import pytest

from dsrun.config import load_ds_config, validate_ds_config
from dsrun.config.ledger import LEDGER, Status
from dsrun.config.model import DSConfig
from dsrun.config.schema_keys import schema_keys
from dsrun.config.support import NOT_IMPLEMENTED, explain, render_markdown, status_counts
from dsrun.utils.errors import ConfigError, UserError

REPO = Path(__file__).resolve().parents[3]
IMPLEMENTED = sorted(k for k, e in LEDGER.items() if e.status == Status.IMPLEMENTED)
MBS = {"train_micro_batch_size_per_gpu": 1}


def test_every_schema_key_has_exactly_one_entry():
    schema = set(schema_keys(DSConfig))
    assert not schema - set(LEDGER), f"schema keys without a ledger entry: {sorted(schema - set(LEDGER))}"
    assert not set(LEDGER) - schema, f"ledger entries for no schema key: {sorted(set(LEDGER) - schema)}"


def _test_function(path: Path, name: str) -> ast.FunctionDef | None:
    tree = ast.parse(path.read_text())
    return next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name), None)


@pytest.mark.parametrize("key", IMPLEMENTED)
def test_an_implemented_key_names_tests_that_exist_and_change_it(key):
    entry = LEDGER[key]
    assert entry.proof, f"{key}: implemented without a proof"
    mentioned = []
    for proof in entry.proof:
        file, _, test = proof.partition("::")
        name, _, case = test.partition("[")
        path = REPO / file
        assert path.is_file(), f"{key}: {file} does not exist"
        assert _test_function(path, name) is not None, f"{key}: {file} has no {name}"
        if case:  # a case of a parametrized effect test: the module must register this key
            module = importlib.import_module(file[:-3].replace("/", "."))
            cases = getattr(module, "EFFECTS", None) or getattr(module, "CASES")
            assert case[:-1] in cases, f"{key}: {proof} has no case for it"
            mentioned.append(proof)
        elif key.split(".")[-1] in path.read_text():  # an ordinary test file that talks about the key
            mentioned.append(proof)
    # a feature's keys share its tests; at least one of them must be about this key
    assert mentioned, f"{key}: none of {entry.proof} mentions it"


def test_keys_without_effect_are_few_and_justified():
    by_design = {k: e for k, e in LEDGER.items() if e.status == Status.BY_DESIGN}
    # 19 of ~440: the two quantizer kernels, related_modules x3, disable_allgather (DeepSpeed reads it nowhere),
    # weight_quantization's num_bits/q_type/q_groups (DeepSpeed reads them into its section and uses them nowhere) ...
    assert len(by_design) <= 19, sorted(by_design)
    for key, entry in by_design.items():
        assert len(entry.reason) >= 40, f"{key}: say why it needs no effect"


def test_not_implemented_keys_say_what_to_do():
    for key, entry in LEDGER.items():
        if entry.status == Status.NOT_IMPLEMENTED:
            assert entry.feature is not None and entry.feature.advice, key


def test_the_docs_table_is_generated_from_the_ledger():
    docs = (REPO / "docs" / "config_support.md").read_text()
    assert docs == render_markdown(), "regenerate: python -m dsrun config --support-table > docs/config_support.md"
    counts = status_counts()
    assert sum(counts.values()) == len(LEDGER) and f"{len(LEDGER)} keys: " in docs


# --- the verdict ------------------------------------------------------------------------------------------------------
def paths(config: dict, **kwargs) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [p.path for p in validate_ds_config({**MBS, **config}, **kwargs)]


ENABLED = {  # what dsrun does not implement (yet)
    "amp": {"enabled": True},
    "aio": {"use_gds": True},
    "nebula": {"enabled": True},
    "data_efficiency": {"enabled": True, "seed": 7, "data_routing": {"enabled": True, "random_ltd": {
        "enabled": True, "total_layer_num": 12, "random_ltd_layer_num": 2, "random_ltd_layer_id": [1, 2],
        "model_mask_name": None, "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
        "random_ltd_schedule": {"min_value": 32, "max_value": 197, "schedule_type": "fixed_linear",
                                "schedule_config": {"require_steps": 10, "seq_per_step": 8}},
        "layer_token_lr_schedule": {"enabled": True, "total_layer_tokens": 100}}}},
}
REFUSED = ["amp.enabled", "aio.use_gds", "nebula.enabled",
           "data_efficiency.data_routing.random_ltd.layer_token_lr_schedule.enabled"]
# what the features merged since the ledger began make act: enabling them is no longer refused
IMPLEMENTED_FEATURES = {
    "compile": {"enabled": True, "backend": "inductor"},
    "hybrid_engine": {"enabled": True, "max_out_tokens": 256},
    "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True},
    "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True,
                                                                           "quantize_weight_in_forward": True},
                                                     "different_groups": {"wq": {"params": {"target_bits": 4}}}}},
    "progressive_layer_drop": {"enabled": True, "theta": 0.5},
    "sparse_attention": {"mode": "fixed"},
    "pipeline": {"schedule": "gpipe", "pipe_partitioned": False},
    "curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 64,
                            "schedule_type": "fixed_linear",
                            "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}},
    "data_efficiency": {k: v for k, v in ENABLED["data_efficiency"].items() if k != "data_routing"},
}


def test_enabling_a_not_implemented_feature_is_refused_one_line_per_key():
    with pytest.raises(ConfigError) as err:
        load_ds_config({**MBS, **ENABLED}, path_prefix="ds")
    assert sorted(p.path for p in err.value.problems) == sorted(f"ds.{p}" for p in REFUSED)
    for problem in err.value.problems:
        assert NOT_IMPLEMENTED in problem.message and "ds.dsrun_allow_unimplemented: true" in problem.hint
    amp = next(p for p in err.value.problems if p.path == "ds.amp.enabled")
    assert "NVIDIA Apex" in amp.message and '"bf16"' in amp.hint and '"fp16"' in amp.hint


def test_the_allow_flag_turns_each_refusal_into_one_warning_line():
    cfg = load_ds_config({**MBS, **ENABLED, "dsrun_allow_unimplemented": True})
    assert sorted(cfg.unimplemented) == sorted(REFUSED)
    assert len(cfg.unimplemented_warnings) == len(REFUSED)
    assert all(line.startswith("warning: ") and "WITHOUT" in line for line in cfg.unimplemented_warnings)


def test_features_that_act_now_are_not_refused():
    assert paths(IMPLEMENTED_FEATURES) == []


def test_defaults_and_disabled_sections_stay_silent():
    assert paths({  # every key written at its default, or inside a disabled section: DeepSpeed ignores them too
        "activation_checkpointing": {"partition_activations": False, "number_checkpoints": None, "profile": False},
        "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": False, "quantize_groups": 8},
                                                         "different_groups": {"wq": {"params": {"target_bits": 4}}}}},
        "progressive_layer_drop": {"enabled": False, "theta": 0.5}, "pipeline": {"stages": "auto"},
        "data_efficiency": {"enabled": False, "seed": 7, "data_sampling": {"num_workers": 2}},
        "zero_optimization": {"stage": 2, "contiguous_gradients": False, "allgather_partitions": False,
                              "zero_quantized_weights": True, "grad_hooks": False},
        "amp": {"enabled": False, "opt_level": "O1"},
    }) == []


def test_a_key_deepspeed_reads_only_at_some_stages_is_refused_only_there():
    key = "legacy_stage1"  # DeepSpeed's stage 1 from before 0.5.8
    assert paths({"zero_optimization": {"stage": 3, key: True}}) == []
    assert paths({"zero_optimization": {"stage": 1, key: True}}) == [f"zero_optimization.{key}"]


def test_grad_accum_dtype_is_refused_where_dsrun_accumulates_otherwise():
    accum = {"data_types": {"grad_accum_dtype": "fp32"}}
    assert paths({"bf16": {"enabled": True}, **accum}) == ["data_types.grad_accum_dtype"]  # bf16 at stage 0
    assert paths({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}, **accum}) == []
    assert paths(accum) == []  # an fp32 model accumulates in fp32
    assert paths({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}) == []


@pytest.mark.parametrize("name, says", [("MuAdam", "mup"), ("MuAdamW", "mup"), ("MuSGD", "mup")])
def test_optimizers_dsrun_lacks_are_refused_with_the_right_reason_even_when_allowed(name, says):
    for allow in (False, True):
        with pytest.raises(ConfigError) as err:
            load_ds_config({**MBS, "optimizer": {"type": name}, "dsrun_allow_unimplemented": allow})
        (problem,) = err.value.problems
        assert problem.path == "optimizer.type" and says in problem.message and "CUDA/NCCL" not in problem.message


def test_deepspeedexamples_vit_random_ltd_config_validates():
    # DeepSpeedExamples' ViT fine-tuning writes model_mask_name: null (a ViT has no attention mask)
    de = copy.deepcopy(ENABLED["data_efficiency"])
    del de["data_routing"]["random_ltd"]["layer_token_lr_schedule"]
    vit = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 32, "data_efficiency": de}
    assert validate_ds_config(vit) == []


def test_explain_gives_type_default_status_and_meaning():
    text = explain("ds.zero_optimization.reduce_bucket_size")
    assert "int >= 0" in text and "500000000" in text and "implemented (proof: tests/" in text
    assert "not implemented: refused when enabled" in explain("nebula.persistent_time_interval")
    assert "implemented (proof: tests/unit/compression/" in explain(
        "compression_training.weight_quantization.different_groups.my_group.params.start_bits")
    assert "no effect by design" in explain("zero_optimization.contiguous_gradients")
    with pytest.raises(UserError, match="did you mean 'zero_optimization.reduce_bucket_size'"):
        explain("zero_optimization.reduce_buket_size")
