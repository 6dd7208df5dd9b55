"""``checkpoint=``: every form of weights init_inference reads, and one line for every form it cannot.
(ZeRO training checkpoints of every stage: tests/integration/test_inference_checkpoint.py.)"""
from __future__ import annotations

import json

import pytest
import torch

import dsrun
from dsrun.inference.loading import read_state_dict
from dsrun.models.gpt import GPT
from dsrun.utils.errors import ConfigError, UserError

SHAPE = {"vocab_size": 32, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 16}


def gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(**{**SHAPE, **overrides})


@pytest.fixture
def trained(tmp_path):
    """A model with its own weights, saved as a state-dict file (tied weight stored once, both names)."""
    model = gpt(seed=7).eval()
    path = tmp_path / "pytorch_model.bin"
    torch.save(model.state_dict(), path)
    return model, path


def logits_of(engine_or_model) -> torch.Tensor:
    with torch.no_grad():
        return engine_or_model(torch.arange(8)[None, :] % 32)


def test_a_state_dict_file_a_folder_and_base_dir(trained, tmp_path):
    model, path = trained
    want = logits_of(model)
    for kwargs in ({"checkpoint": str(path)}, {"checkpoint": str(tmp_path)},
                   {"checkpoint": "pytorch_model.bin", "base_dir": str(tmp_path)},
                   {"checkpoint_config": {"checkpoint_dir": str(path)}},
                   {"ckpt_config": {"checkpoint_dir": "pytorch_model.bin", "base_dir": str(tmp_path)}}):
        engine = dsrun.init_inference(gpt(), dtype="fp32", **kwargs)
        torch.testing.assert_close(logits_of(engine), want, rtol=0, atol=0)
        assert engine.checkpoint_loaded.endswith("pytorch_model.bin")


def test_deepspeeds_checkpoint_description_as_dict_or_json_file(trained, tmp_path):
    model, path = trained
    state = model.state_dict()
    first, second = dict(list(state.items())[:5]), dict(list(state.items())[5:])
    torch.save(first, tmp_path / "part1.pt")
    torch.save(second, tmp_path / "part2.pt")
    description = {"type": "ds_model", "version": 0.0, "checkpoints": ["part1.pt", "part2.pt"]}
    (tmp_path / "checkpoint.json").write_text(json.dumps(description))
    want = logits_of(model)
    for source in (str(tmp_path / "checkpoint.json"), {**description, "base_dir": str(tmp_path)}):
        torch.testing.assert_close(logits_of(dsrun.init_inference(gpt(), dtype="fp32", checkpoint=source)), want,
                                   rtol=0, atol=0)
    with pytest.raises(UserError, match="type 'Megatron' is not supported"):
        read_state_dict({"type": "Megatron", "checkpoints": ["mp_rank_00/model_optim_rng.pt"]})


def test_safetensors_with_a_tied_weight_named_in_the_metadata(trained, tmp_path):
    from safetensors.torch import save_file

    model, _ = trained
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(tensors, tmp_path / "model.safetensors",
              metadata={"dsrun_shared_params": json.dumps({"lm_head.weight": "transformer.wte.weight"})})
    engine = dsrun.init_inference(gpt(), dtype="fp32", checkpoint=str(tmp_path / "model.safetensors"))
    torch.testing.assert_close(logits_of(engine), logits_of(model), rtol=0, atol=0)


def test_a_model_built_on_meta_is_filled_from_the_checkpoint(trained):
    model, path = trained
    with torch.device("meta"):
        empty = GPT(**SHAPE)
    engine = dsrun.init_inference(empty, dtype="fp32", set_empty_params=True, checkpoint=str(path))
    torch.testing.assert_close(logits_of(engine), logits_of(model), rtol=0, atol=0)
    with torch.device("meta"):
        empty = GPT(**SHAPE)
    with pytest.raises(ConfigError, match="meta device"):
        dsrun.init_inference(empty, dtype="fp32", checkpoint=str(path))
    with pytest.raises(ConfigError, match="set_empty_params: needs a checkpoint"):
        dsrun.init_inference(gpt(), dtype="fp32", set_empty_params=True)


def test_a_checkpoint_that_does_not_fit_is_one_line(trained):
    _, path = trained
    with pytest.raises(UserError) as caught:
        dsrun.init_inference(gpt(n_embd=32), dtype="fp32", checkpoint=str(path))
    (problem,) = caught.value.problems
    assert "does not fit GPT: 29 shape mismatches (transformer.wte.weight: checkpoint [32, 16], model [32, 32]" \
        in str(problem)
    with pytest.raises(UserError) as caught:
        dsrun.init_inference(gpt(n_layer=3), dtype="fp32", checkpoint=str(path))
    assert "missing keys (transformer.h.2.ln_1.weight" in str(caught.value)


def _unreadable(root, kind):
    """A source of each unreadable kind under ``root``."""
    if kind == "missing":
        return root / "nothing"
    if kind == "run without checkpoints":
        (root / "run").mkdir()
        (root / "run" / "resolved.yaml").write_text("model: {}\n")
        return root / "run"
    if kind == "empty folder":
        (root / "empty").mkdir()
        return root / "empty"
    if kind == "not a dict":
        torch.save([1, 2], root / "list.pt")
        return root / "list.pt"
    if kind == "not torch":
        (root / "notes.txt").write_text("hello")
        return root / "notes.txt"
    if kind == "one rank's file":
        torch.save({"module": {}, "buffer_names": []}, root / "mp_rank_00_model_states.pt")
        return root / "mp_rank_00_model_states.pt"
    (root / "bad.json").write_text("{")
    return root / "bad.json"


@pytest.mark.parametrize("kind, message", [
    ("missing", "no such file or folder"), ("run without checkpoints", "has no checkpoint"),
    ("empty folder", "holds no checkpoint"), ("not a dict", "does not hold a state dict"),
    ("not torch", "it is truncated or not a torch file"), ("one rank's file", "one rank's model-states file"),
    ("bad json", "is not valid JSON"),
])
def test_unreadable_sources_are_one_line_each(tmp_path, kind, message):
    with pytest.raises(UserError) as caught:
        read_state_dict(str(_unreadable(tmp_path, kind)))
    (problem,) = caught.value.problems
    assert problem.path == "init_inference.checkpoint" and message in problem.message
