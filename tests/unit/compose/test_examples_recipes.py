"""The recipe walkthrough in examples/README.md says what it does."""
from dsrun.compose import compose_runspec
from dsrun.runspec import resolve_run
from tests.helpers import REPO

EXAMPLE_RECIPES = REPO / "examples" / "my_recipes"


def test_walkthrough_recipe_equals_its_command_line():
    from_recipe = compose_runspec(["+recipe=tiny_bf16_zero1"], recipes_dirs=[EXAMPLE_RECIPES])
    from_command_line = compose_runspec([
        "zero=stage1", "precision=bf16", "optimizer=lion", "scheduler=warmup_decay", "train.max_steps=100",
        "train.eval_interval=25", "ds.train_micro_batch_size_per_gpu=8", "gradient_accumulation_steps=2",
        "scheduler.params.warmup_max_lr=3e-4", "scheduler.params.warmup_num_steps=10"])
    assert from_recipe.ds == from_command_line.ds
    assert from_recipe.train == from_command_line.train


def test_walkthrough_recipe_validates():
    run = resolve_run(compose_runspec(["+recipe=tiny_bf16_zero1"], recipes_dirs=[EXAMPLE_RECIPES]))
    assert run.ds.zero_optimization.stage == 1 and run.ds.bf16.enabled
    assert run.ds.train_batch_size == 8 * 2 * 2
