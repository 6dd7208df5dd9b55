"""Hydra composition: groups, recipes, overrides, ds_config files and the errors users see."""
import json

import pytest

from dsrun.compose import compose_runspec, list_recipes, normalize_overrides
from dsrun.runspec import resolve_run
from dsrun.utils.errors import UserError


def problems_of(overrides, **kwargs):
    with pytest.raises(UserError) as info:
        resolve_run(compose_runspec(overrides, **kwargs))
    return [str(p) for p in info.value.problems]


def test_default_recipe_is_used_without_one():
    cfg = compose_runspec([])
    assert cfg.ds.zero_optimization.stage == 2  # recipes/default.yaml overrides zero
    assert list(cfg)[:5] == ["model", "data", "train", "launcher", "ds"]


def test_recipe_overrides_groups_and_ds_keys_land_in_ds():
    cfg = compose_runspec(["+recipe=gpt_zero3", "precision=bf16", "optimizer=lion"])
    assert cfg.ds.zero_optimization.stage == 3
    assert cfg.ds.bf16.enabled is True
    assert cfg.ds.optimizer.type == "Lion"
    assert cfg.model.n_layer == 4 and cfg.model.block_size == 256  # gpt-micro


def test_ds_shorthand_and_explicit_forms_agree():
    short = compose_runspec(["optimizer.params.lr=3e-4", "gradient_clipping=0.5"])
    explicit = compose_runspec(["ds.optimizer.params.lr=3e-4", "ds.gradient_clipping=0.5"])
    assert short.ds == explicit.ds
    assert short.ds.optimizer.params.lr == pytest.approx(3e-4)
    assert short.ds.gradient_clipping == 0.5


def test_group_choice_is_not_rewritten():
    overrides, _ = normalize_overrides(["optimizer=sgd", "+ds.dump_state=true"])
    assert "optimizer=sgd" in overrides and "+ds.dump_state=true" in overrides
    assert overrides[0] == "+recipe=default"


def test_interpolations_are_resolved():
    cfg = compose_runspec(["train.max_steps=77"])
    assert cfg.ds.scheduler.params.total_num_steps == 77


def test_ds_config_file_merges_and_command_line_wins(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_clipping": 0.25, "zero_optimization": {"stage": 1},
                                "steps_per_print": 7}))
    cfg = compose_runspec([f"ds_config={path}", "ds.steps_per_print=3"])
    assert cfg.ds.gradient_clipping == 0.25  # the file beats the recipe's groups
    assert cfg.ds.zero_optimization.stage == 1
    assert cfg.ds.steps_per_print == 3  # the command line beats the file


def test_missing_ds_config_file_names_the_key(tmp_path):
    assert any(p.startswith("ds_config: file not found") for p in problems_of([f"ds_config={tmp_path}/nope.json"]))


def test_user_recipe_dir_shadows_and_adds(tmp_path):
    (tmp_path / "mine.yaml").write_text("# @package _global_\n# my recipe\ndefaults:\n  - override /zero: stage1\n"
                                        "train:\n  max_steps: 5\n")
    cfg = compose_runspec(["+recipe=mine"], recipes_dirs=[tmp_path])
    assert cfg.ds.zero_optimization.stage == 1 and cfg.train.max_steps == 5
    assert list_recipes([tmp_path])["mine"][1] == "my recipe"


@pytest.mark.parametrize("overrides, expected", [
    (["+recipe=gpt_zero9"], "+recipe=gpt_zero9: unknown recipe 'gpt_zero9'; available: default"),
    (["zero=stage9"], "zero=stage9: unknown option 'stage9' for config group 'zero'"),
    (["ds.gradient_clip=1.0"], "ds.gradient_clip: no such key in the composed config (did you mean 'gradient_clipping'?"),
    (["train.max_step=3"], "train.max_step: no such key"),
    (["x=["], "x=[: cannot parse this override"),
])
def test_composition_errors_name_the_override(overrides, expected):
    with pytest.raises(UserError) as info:
        compose_runspec(overrides)
    assert str(info.value.problems[0]).startswith(expected)


def test_unknown_recipe_lists_available_and_suggests():
    message = str(pytest.raises(UserError, compose_runspec, ["+recipe=gpt_zro3"]).value)
    assert "gpt_zero3" in message and "did you mean 'gpt_zero3'?" in message


def test_missing_recipe_dir_is_an_error(tmp_path):
    with pytest.raises(UserError, match="recipe folder not found"):
        compose_runspec([], recipes_dirs=[tmp_path / "absent"])


def test_every_recipe_has_a_description():
    recipes = list_recipes()
    assert {"default", "gpt_zero0", "gpt_zero1", "gpt_zero2", "gpt_zero3"} <= set(recipes)
    assert all(description for _, description in recipes.values())


def test_hydra_searchpath_recipes(tmp_path):
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "viasp.yaml").write_text("# @package _global_\n# via searchpath\ntrain:\n  max_steps: 7\n")
    cfg = compose_runspec([f"hydra.searchpath=[file://{tmp_path}]", "+recipe=viasp"])
    assert cfg.train.max_steps == 7


def test_malformed_recipe_yaml_names_file_and_line(tmp_path):
    (tmp_path / "broken.yaml").write_text("# @package _global_\n# broken\ntrain: [1, 2\n")
    with pytest.raises(UserError) as info:
        compose_runspec(["+recipe=broken"], recipes_dirs=[tmp_path])
    (problem,) = info.value.problems
    assert problem.path.startswith(str(tmp_path / "broken.yaml") + ":") and "malformed YAML" in problem.message


def test_documented_deepspeed_keys_the_recipe_leaves_out_need_no_plus():
    """A DeepSpeed user writes ds.tensorboard.output_path=... as the config file would have it; the schema
    documents the key, so it is added. An undocumented key still needs '+' (it is refused unless added)."""
    cfg = compose_runspec(["ds.tensorboard.enabled=true", "tensorboard.output_path=/tmp/tb",
                           "ds.zero_optimization.stage=3"])
    assert cfg.ds.tensorboard.enabled is True and cfg.ds.tensorboard.output_path == "/tmp/tb"
    assert cfg.ds.zero_optimization.stage == 3  # a key the recipe sets is overridden as before
    with pytest.raises(UserError, match="ds.tensorboard.not_a_key: no such key"):
        compose_runspec(["ds.tensorboard.not_a_key=1"])


@pytest.mark.parametrize("override, suggestion", [
    ("optimizer.params.lrr=1", "did you mean 'lr'?"),                  # a key beside it in the composed config
    ("ds.tensorboard.enabeld=true", "did you mean 'enabled'?"),         # a key the DeepSpeed schema documents
    ("model.n_laye=2", "did you mean 'n_layer'?"),
])
def test_a_misspelt_key_gets_did_you_mean_not_the_plus_hint(override, suggestion):
    (problem,) = pytest.raises(UserError, compose_runspec, [override]).value.problems
    assert problem.hint == suggestion


def test_a_new_key_with_nothing_close_is_told_how_to_add_it():
    (problem,) = pytest.raises(UserError, compose_runspec, ["train.completely_new=1"]).value.problems
    assert problem.hint == "to add a new key write +train.completely_new=1"


def test_composing_from_a_run_directory_keeps_its_values_and_takes_overrides(tmp_path):
    """dsrun train --from RUN_DIR: composition starts from the run's .hydra/config.yaml, with no recipe added."""
    from omegaconf import OmegaConf

    from dsrun.compose import compose_runspec as compose

    recorded = OmegaConf.to_container(compose_runspec(["+recipe=gpt_zero3", "train.max_steps=9"], resolve=False))
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(recorded)))
    again = compose(["train.max_steps=12"], source=tmp_path)
    assert again.ds.zero_optimization.stage == 3 and again.train.max_steps == 12
    assert again.ds.scheduler.params.total_num_steps == 12  # interpolations were kept, so they follow
