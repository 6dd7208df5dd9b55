"""``dsrun launch``'s check of the script's DeepSpeed config before any rank starts: batch arithmetic that no
data-parallel share of the launched ranks fits is refused here (one line, exit 2, --dry-run too); what some
share fits (the script may pipeline or shard the model) is left to the ranks."""
import json

import pytest

from dsrun.cli.launch import check_script_config
from dsrun.utils.errors import ConfigError


def _config(tmp_path, **values):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, **values}))
    return ["--deepspeed", "--deepspeed_config", str(path)]


def test_batch_arithmetic_no_data_parallel_share_fits_is_refused_before_launch(tmp_path):
    args = _config(tmp_path, train_batch_size=7, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1)
    with pytest.raises(ConfigError) as err:
        check_script_config(args, world_size=2)
    (problem,) = err.value.problems
    assert str(problem).startswith("train_batch_size: train_batch_size 7 != train_micro_batch_size_per_gpu 2 * "
                                   "gradient_accumulation_steps 1 * world size 2 = 4 (world size 2, from dsrun "
                                   "launch: 2 ranks)")


@pytest.mark.parametrize("world,fits", [(8, True), (4, True), (3, False), (1, False)])
def test_a_share_of_the_ranks_that_fits_is_left_to_the_script(tmp_path, world, fits):
    """8 = 2 * 1 * 4: four data-parallel ranks (of 8 with 2 pipeline stages, or of 4) fit; 3 or 1 ranks never do."""
    args = _config(tmp_path, train_batch_size=8, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1)
    if fits:
        check_script_config(args, world_size=world)
    else:
        with pytest.raises(ConfigError, match="train_batch_size"):
            check_script_config(args, world_size=world)


def test_without_a_config_file_or_a_world_nothing_is_checked(tmp_path):
    check_script_config(["--deepspeed"], world_size=2)
    check_script_config(_config(tmp_path, train_batch_size=7, train_micro_batch_size_per_gpu=2), world_size=None)
