"""The ``activation_checkpointing`` section: ``configure``'s precedence, each key acting (or refused), the
engine reading it at initialize. Partitioning over a real model-parallel group, the contiguous buffer and
``number_checkpoints`` are proved with two ranks in tests/integration/test_activation_checkpointing.py."""
from __future__ import annotations

import json
import warnings
from unittest import mock

import pytest
import torch
from torch import nn

import dsrun.activation_checkpointing.api as ckpt
from dsrun.accelerator import get_accelerator
from dsrun.config import load_ds_config
from dsrun.models.gpt import GPT
from dsrun.activation_checkpointing.settings import STATE, reset_configuration
from dsrun.utils.errors import ConfigError

TINY = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture(autouse=True)
def fresh_configuration():
    reset_configuration()
    STATE.said.clear()
    yield
    reset_configuration()


def _train_once(model: nn.Module) -> None:
    idx = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    model(idx, idx).backward()


def test_configure_reads_the_section_and_arguments_override_it(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "activation_checkpointing": {
        "profile": True, "synchronize_checkpoint_boundary": True, "cpu_checkpointing": True}}))
    assert not ckpt.is_configured()
    ckpt.configure(None, deepspeed_config=str(path), synchronize=False)
    assert ckpt.is_configured()
    s = STATE.settings
    assert (s.profile, s.synchronize_checkpoint_boundary, s.cpu_checkpointing) == (True, False, True)
    ckpt.configure(None, deepspeed_config={"activation_checkpointing": {"partition_activations": True}})
    assert STATE.settings.partition_activations and not STATE.settings.profile  # every call starts afresh


@pytest.mark.parametrize("section, path", [
    ({"contiguous_memory_optimization": True, "number_checkpoints": 4}, "contiguous_memory_optimization"),
    ({"contiguous_memory_optimization": True, "partition_activations": True}, "number_checkpoints"),
    ({"partition_activation": True}, "partition_activation"),
])
def test_what_deepspeed_refuses_is_a_config_error_naming_the_key(section, path):
    with pytest.raises(ConfigError, match=f"activation_checkpointing.{path}"):
        ckpt.configure(None, deepspeed_config={"activation_checkpointing": section})
    with pytest.raises(ConfigError, match=f"ds.activation_checkpointing.{path}"):
        load_ds_config({"train_batch_size": 8, "activation_checkpointing": section}, path_prefix="ds")


def test_synchronize_checkpoint_boundary_synchronizes_around_forward_and_recompute():
    model = GPT(**TINY, activation_checkpointing="full")
    with mock.patch.object(type(get_accelerator()), "synchronize") as sync:
        _train_once(model)
        assert sync.call_count == 0
        ckpt.configure(None, synchronize=True)
        _train_once(model)
    assert sync.call_count == 2 * 2 * TINY["n_layer"]  # start and end of each forward and each recompute


def test_profile_prints_each_checkpoints_forward_and_recompute_time(capsys):
    model = GPT(**TINY, activation_checkpointing="full")
    _train_once(model)
    assert "activation checkpoint" not in capsys.readouterr().out
    ckpt.configure(None, profile=True)
    _train_once(model)
    lines = [line for line in capsys.readouterr().out.splitlines() if "activation checkpoint" in line]
    phases = [line.split(": ")[1].rsplit(" ", 2)[0] for line in lines]
    assert phases == ["forward", "forward", "recompute", "recompute"]
    assert [line.split("checkpoint ")[1].split(":")[0] for line in lines] == ["0", "1", "1", "0"]
    assert all(line.endswith(" ms") for line in lines)


def test_reentrant_profile_times_recompute_and_backward(capsys):
    ckpt.configure(None, profile=True)
    lin = nn.Linear(4, 4)
    ckpt.checkpoint(lin, torch.randn(2, 4)).sum().backward()
    out = capsys.readouterr().out
    assert "activation checkpoint 0: forward" in out and "activation checkpoint 0: recompute and backward" in out


def test_cpu_checkpointing_keeps_inputs_on_the_host_and_says_once_that_a_cpu_rank_has_nothing_to_move():
    ckpt.configure(None, checkpoint_in_cpu=True)
    model = GPT(**TINY, activation_checkpointing="full")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train_once(model)
        _train_once(model)
    messages = [str(w.message) for w in caught if "cpu_checkpointing" in str(w.message)]
    assert len(messages) == 1 and "already in host memory" in messages[0]


def test_partition_activations_without_a_model_parallel_group_says_so_once():
    ckpt.configure(None, partition_activations=True)
    model = GPT(**TINY, activation_checkpointing="full")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train_once(model)
        _train_once(model)
    assert len([w for w in caught if "model-parallel group has one rank" in str(w.message)]) == 1


def test_partition_and_layer_count_setters():
    ckpt.partition_activations_in_checkpoint(True)
    ckpt.set_num_layers(12)
    assert STATE.settings.partition_activations and STATE.settings.number_checkpoints == 12


def test_initialize_configures_from_the_section(world_of_one):
    import dsrun

    config = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "activation_checkpointing": {"profile": True}}
    dsrun.initialize(model=GPT(**TINY, activation_checkpointing="selective"), config=config)
    assert ckpt.is_configured() and STATE.settings.profile
    reset_configuration()
    dsrun.initialize(model=GPT(**TINY), config={k: v for k, v in config.items() if k != "activation_checkpointing"})
    assert not ckpt.is_configured()  # no section: DeepSpeed leaves configure to the user, so does dsrun


def test_a_section_with_nothing_to_checkpoint_says_so(world_of_one):
    import dsrun

    config = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "activation_checkpointing": {"profile": True}}
    with pytest.warns(UserWarning, match="activation_checkpointing.profile .*model.activation_checkpointing is none"):
        dsrun.initialize(model=GPT(**TINY), config=config)
