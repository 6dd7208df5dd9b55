"""``dsrun convert to-hf``: dsrun's GPT and a Hugging Face GPT-2 trained through dsrun's engine (what the
``deepspeed`` alias serves: ``deepspeed.initialize is dsrun.initialize``), each saved at ZeRO-3 on one rank and
loaded back with ``AutoModelForCausalLM.from_pretrained``; the GPT's other options (rotary positions as GPT-NeoX,
no biases, an untied head) mapped in process; sharded output; refusals as one line and exit 2.

The logits bound. dsrun's GPT and ``GPT2LMHeadModel`` compute the same function with the same torch ops, but for
one: GPT-2's ``Conv1D`` multiplies by the transposed weight (``addmm(b, x, W)``) where ``nn.Linear`` multiplies by
``W.t()``; a BLAS may sum that product in another order (GPT-NeoX's projections are ``nn.Linear``, its rotation
the same products and sums, but its value rows are another strided view for attention). Two fp32 orderings of
one computation each land within fp32's rounding of the exact result, so the bound is measured on the model
itself as tests/tolerance.py does: the export must land no further from dsrun's fp32 logits than ``K + 1`` times
dsrun's own distance from its float64 logits (the triangle inequality, ``K`` bracketing an ordering outside
dsrun's). With MKL the orders agree and the difference is exactly 0. A wrong mapping (an untransposed weight or
GPT-2's tanh GELU) is orders of magnitude above it. The Hugging Face model exported under its
own class runs the very same ops: equal bits.
"""
from __future__ import annotations

import json

import pytest
import torch
import yaml

from dsrun.checkpoint.hf_folder import write_pretrained
from dsrun.cli.__main__ import main
from dsrun.models.gpt import GPT
from dsrun.models.hf import gpt_state_shapes, gpt_to_hf, key_differences
from dsrun.models.registry import GPT_TARGET
from dsrun.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from tests.tolerance import K

from .conftest import make_engine, train

pytestmark = pytest.mark.usefixtures("single_rank")
transformers = pytest.importorskip("transformers")


def _tokens(vocab: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (3, seq), generator=torch.Generator().manual_seed(5))


def _load(out):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert all(not keys for keys in info.values()), info  # no missing, unexpected or mismatched key
    return model.eval()


def _fp32_spread(config, state, tokens: torch.Tensor, logits: torch.Tensor) -> float:
    """dsrun's own fp32 rounding: the largest distance of ``logits`` from the float64 logits of the same weights."""
    wide = GPT(config).double().eval()
    wide.load_state_dict({k: v.double() for k, v in state.items()})
    return (wide(tokens).float() - logits).abs().max().item()


def _export(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()  # what came before (transformers' loading bars) is not the command's
    code = main(["convert", "to-hf", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory, single_rank):
    """A run directory of dsrun's GPT (learned positions, tied head), trained 2 steps at ZeRO-3: its resolved
    model, its checkpoints and the trained model's logits on fixed tokens."""
    run = tmp_path_factory.mktemp("run")
    engine = make_engine(3, "fp32", dropout=0.0)
    train(engine, 2)
    engine.save_checkpoint(str(run / "checkpoints"))
    config = engine.module.config
    (run / "resolved.yaml").write_text(yaml.safe_dump({"model": {"_target_": GPT_TARGET, **config.to_dict()}}))
    tokens = _tokens(config.vocab_size, config.block_size)
    engine.module.eval()
    with torch.no_grad():
        logits = engine.module(tokens)  # the trained model, its ZeRO-3 partitions gathered for the forward
        weights = get_fp32_state_dict_from_zero_checkpoint(str(run / "checkpoints"))  # at fp32: the same weights
        spread = _fp32_spread(config, weights, tokens, logits)
    return run, tokens, logits, spread


def test_gpt_round_trip_from_a_run_directory(gpt_run, tmp_path, capsys):
    run, tokens, logits, spread = gpt_run
    code, out, err = _export(capsys, run, tmp_path / "hf")
    assert code == 0, err
    assert "(GPT-2): 28 tensors" in out and "1 file(s)" in out
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["activation_function"] == "gelu" and config["tie_word_embeddings"]
    model = _load(tmp_path / "hf")
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # tied again on load
    with torch.no_grad():
        exported = model(tokens).logits
    assert 0 < spread < 1e-4
    assert (exported - logits).abs().max().item() <= (K + 1) * spread


def test_sharded_export_loads_and_replaces_an_earlier_one(gpt_run, tmp_path, capsys):
    run, tokens, logits, spread = gpt_run
    out = tmp_path / "hf"
    code, printed, err = _export(capsys, run / "checkpoints" / "global_step2", out, "--max-shard-size", "8KB")
    assert code == 0, err
    assert "+ index" in printed
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(shards) > 3 and sorted(set(index["weight_map"].values())) == shards
    assert not (out / "model.safetensors").exists()
    model = _load(out)
    assert index["metadata"]["total_size"] == 4 * sum(p.numel() for p in model.parameters())  # fp32, tied once
    with torch.no_grad():
        sharded = model(tokens).logits
    assert (sharded - logits).abs().max().item() <= (K + 1) * spread
    assert _export(capsys, run / "checkpoints", out, "--config", run / "resolved.yaml")[0] == 0  # one file now
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with torch.no_grad():
        assert torch.equal(_load(out)(tokens).logits, sharded)


@pytest.mark.parametrize("options,family", [
    ({"positions": "rotary"}, "GPTNeoXForCausalLM"),
    ({"positions": "rotary", "bias": False, "tie_embeddings": False, "n_head": 4, "rotary_base": 500.0},
     "GPTNeoXForCausalLM"),
    ({"bias": False, "tie_embeddings": False}, "GPT2LMHeadModel"),
])
def test_gpt_options_map_to_their_family(tmp_path, options, family):
    torch.manual_seed(0)
    model = GPT(**{"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32, **options}).eval()
    assert key_differences(gpt_state_shapes(model.config), model.state_dict()) is None
    exported = gpt_to_hf(model.config, model.state_dict())
    write_pretrained(tmp_path, exported.tensors, exported.config)
    loaded = _load(tmp_path)
    assert type(loaded).__name__ == family
    tokens = _tokens(64, 16)
    with torch.no_grad():
        logits = model(tokens)
        spread = _fp32_spread(model.config, model.state_dict(), tokens, logits)
        assert (loaded(tokens).logits - logits).abs().max().item() <= (K + 1) * spread


def test_hugging_face_gpt2_trained_through_the_engine(tmp_path, capsys):
    import dsrun
    from tests.harness.runs import checkpoint_config
    from tests.integration._hf_data import tiny_gpt2_config

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(tiny_gpt2_config())
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(),
                                  config=checkpoint_config(3, "fp32", 4))
    for step in range(2):
        batch = _tokens(64, 16)[:, :16] + step
        engine.backward(engine(input_ids=batch % 64, labels=batch % 64).loss)
        engine.step()
    folder = tmp_path / "checkpoint-2"  # as the Trainer saves: DeepSpeed's checkpoint, the config beside it
    engine.save_checkpoint(str(folder))
    model.config.save_pretrained(str(folder))
    model.generation_config.save_pretrained(str(folder))
    tokens = _tokens(64, 16)
    engine.module.eval()
    with torch.no_grad():
        trained = engine.module(input_ids=tokens).logits
    code, out, err = _export(capsys, folder, tmp_path / "hf")
    assert code == 0, err
    assert "(gpt2): 28 tensors" in out  # the tied head left out, as save_pretrained does
    assert (tmp_path / "hf" / "generation_config.json").is_file()
    with torch.no_grad():
        exported = _load(tmp_path / "hf")(tokens).logits
    assert torch.equal(exported, trained)  # the same class, weights and ops: the same bits
    wrong = {**json.loads((folder / "config.json").read_text()), "n_layer": 3}  # not the model that was trained
    (tmp_path / "wrong.json").write_text(json.dumps(wrong))
    line = _one_error(capsys, folder, tmp_path / "other", "--config", tmp_path / "wrong.json")
    assert "are not those of the model" in line and "missing transformer.h.2." in line


def _one_error(capsys, *args) -> str:
    code, _, err = _export(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def _run_with_model(tmp_path, gpt_run, **changes) -> str:
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(gpt_run[0] / "checkpoints")
    model = yaml.safe_load((gpt_run[0] / "resolved.yaml").read_text())["model"]
    (run / "resolved.yaml").write_text(yaml.safe_dump({"model": {**model, **changes}}))
    return str(run)


@pytest.mark.parametrize("changes,expected", [
    ({"pipeline_stages": 2}, "model.pipeline_stages: 2: a pipelined GPT keeps its weights in per-layer files"),
    ({"_target_": "dsrun.models.moe_gpt.MoEGPT"}, "model._target_: 'dsrun.models.moe_gpt.MoEGPT'"),
    ({"attention": "sparse"}, "model.attention: 'sparse': GPT-2's and GPT-NeoX's attention is dense"),
    ({"n_layer": 3}, "does not hold a GPT of the model in"),
])
def test_refusals_name_the_option(gpt_run, tmp_path, capsys, changes, expected):
    assert expected in _one_error(capsys, _run_with_model(tmp_path, gpt_run, **changes), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_missing_checkpoint_or_config(gpt_run, tmp_path, capsys):
    assert "no such file or folder" in _one_error(capsys, tmp_path / "nothing", tmp_path / "hf")
    (tmp_path / "empty_run").mkdir()
    (tmp_path / "empty_run" / "resolved.yaml").write_text("model: {}\ntrain: {save_interval: 0}\n")
    assert "has no checkpoint" in _one_error(capsys, tmp_path / "empty_run", tmp_path / "hf")
    # a checkpoint folder outside a run, without a config.json: the model must be named
    (tmp_path / "elsewhere").symlink_to(gpt_run[0] / "checkpoints")
    assert "pass --config" in _one_error(capsys, tmp_path / "elsewhere", tmp_path / "hf")
    (tmp_path / "file").write_text("")
    assert "OUT: " in _one_error(capsys, gpt_run[0], tmp_path / "file")
    assert "--tag: no tag 'global_step9'" in _one_error(capsys, gpt_run[0], tmp_path / "hf", "--tag", "global_step9")
