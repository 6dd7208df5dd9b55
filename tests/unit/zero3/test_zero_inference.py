"""ZeRO-Inference's own flow (docs/zero3.md, "ZeRO-Inference"): a model built under ``zero.Init`` (stage 3,
``offload_param`` cpu or not, ``weight_quantization.quantized_initialization`` or not), then ``initialize`` with no
optimizer. The engine holds DeepSpeed's ``DeepSpeedZeRoOffload`` (dsrun/zero/parameter_offload.py): the parameters
stay partitioned and are gathered module by module, so ``engine(...)``, ``engine.module(...)`` and Hugging Face's
``generate`` give the unpartitioned model's outputs. Two gloo ranks: tests/integration/test_zero3_api.py.

Bit for bit, not within a bound: gathering copies each shard's bytes back into place and the forward runs the same
ops on the same values (``F.linear`` is torch's own without gradients), so any difference would be a bug. With
``quantized_initialization`` the reference is the unpartitioned model holding the dequantized weights (the
quantized layers compute with exactly those), and each dequantized weight lies within half its group's step,
``(max - min) / (2**bits - 1) / 2``, of the value drawn without quantization (the same seed under ``zero.Init``).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dsrun
from dsrun.ops.groupwise_quant import dequantized
from dsrun.utils.errors import UserError
from dsrun.zero.partition_params import ParamStatus
from dsrun.zero.partitioner_internals import InsertPostInitMethodToModuleSubClasses

transformers = pytest.importorskip("transformers")
# resolved here, not first inside zero.Init: the lazy import of GPT-2 loads torch._dynamo, whose polyfills refuse the
# tensor constructors zero.Init puts in place for its block
GPT2Config, GPT2LMHeadModel = transformers.GPT2Config, transformers.GPT2LMHeadModel
pytestmark = pytest.mark.usefixtures("world_of_one")
RULE = {"num_bits": 8, "group_size": 16, "group_dim": 1, "symmetric": False}


@pytest.fixture(autouse=True)
def _restore_process_patches(monkeypatch):
    """zero.Init with quantized_initialization wraps F.linear, F.embedding and the layers' state-dict loading for the
    rest of the process, as DeepSpeed's does: put them back after each test."""
    monkeypatch.setattr(F, "linear", F.linear)
    monkeypatch.setattr(F, "embedding", F.embedding)
    for cls in (nn.Linear, nn.Embedding):
        monkeypatch.setattr(cls, "_load_from_state_dict", cls._load_from_state_dict)
    had = "linear_bk" in vars(InsertPostInitMethodToModuleSubClasses)
    saved = vars(InsertPostInitMethodToModuleSubClasses).get("linear_bk")
    yield
    if had:
        InsertPostInitMethodToModuleSubClasses.linear_bk = saved
    elif "linear_bk" in vars(InsertPostInitMethodToModuleSubClasses):
        del InsertPostInitMethodToModuleSubClasses.linear_bk


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).eval()


def _config(**zero: object) -> dict:
    return {"train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}


def _reference(state: dict[str, torch.Tensor]) -> nn.Module:
    """The unpartitioned model holding ``state``."""
    model = _gpt2()
    model.load_state_dict(state)
    return model


def _outputs(engine, reference: nn.Module) -> dict[str, bool]:
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
        tokens = reference.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        return {"engine": torch.equal(engine(ids).logits, expected),
                "module": torch.equal(engine.module(ids).logits, expected),
                "generate": torch.equal(engine.module.generate(ids, max_new_tokens=4, do_sample=False,
                                                               pad_token_id=0), tokens)}


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_a_zero_init_model_without_an_optimizer_gives_the_unpartitioned_outputs(offload, tmp_path):
    config = _config(offload_param={"device": offload}, stage3_gather_16bit_weights_on_model_save=True)
    with dsrun.zero.Init(config_dict_or_path=config):
        model = _gpt2()
    weights = dsrun.zero.full_state_dict(model)
    engine, optimizer, _, _ = dsrun.initialize(model=model, config=config)
    offload_side = engine.parameter_offload
    # DeepSpeed's engine.optimizer (and initialize's second value) is its DeepSpeedZeRoOffload; no torch optimizer
    assert optimizer is engine.optimizer is offload_side and engine.strategy is None and engine.basic_optimizer is None
    assert engine.get_lr() == [] and engine.get_mom() == []
    # a world of one without offload keeps every parameter whole (no hooks); offloaded, the coordinator gathers
    assert offload_side.keeps_whole is (offload == "none")
    reference = _reference(weights)
    assert _outputs(engine, reference) == {"engine": True, "module": True, "generate": True}
    params = list(engine.module.parameters())
    if offload == "cpu":
        assert all(p.ds_status is ParamStatus.NOT_AVAILABLE and p.numel() == 0 for p in params)  # released after use
        # each root forward starts a pass (DeepSpeed's reset_step): the first forward-only pass was recorded, the
        # later ones prefetch along it
        assert offload_side.coordinator.trace_complete and offload_side.coordinator.prefetched_numel > 0
    with dsrun.zero.unwrap_model_for_generation(engine):  # gathered once for the block, the hooks lifted
        assert _outputs(engine, reference) == {"engine": True, "module": True, "generate": True}
        assert all(p.numel() == p.ds_numel for p in params)  # no pass released them
    memory = engine.memory_breakdown()  # the shards (a world of one: each whole), nothing of an optimizer
    assert memory.parameters == sum(p.ds_tensor.numel() * 4 for p in params) and memory.optimizer_states == 0
    # no optimizer to take a gradient (DeepSpeed's engine fails there too, with an AttributeError): refused
    loss = engine(torch.zeros(1, 4, dtype=torch.long)).logits.float().square().mean()
    with pytest.raises(RuntimeError, match="without an optimizer"):
        engine.backward(loss)
    for step in (engine.step, optimizer.step):  # nothing to step, and no step counted
        with pytest.raises(RuntimeError, match=r"step\(\) on a ZeRO-3 engine built without an optimizer"):
            step()
    assert engine.global_steps == 0
    with pytest.raises(UserError, match="no master weights"):
        engine.save_checkpoint(str(tmp_path))
    assert engine.save_16bit_model(str(tmp_path), "model.bin")  # gathered, whole
    saved = torch.load(tmp_path / "model.bin")
    assert all(torch.equal(saved[k], v) for k, v in weights.items())
    engine.destroy()


def test_quantized_initialization_computes_with_weights_within_half_a_step():
    plain = _config()
    with dsrun.zero.Init(config_dict_or_path=plain):
        drawn = dsrun.zero.full_state_dict(_gpt2())  # the same draws, unquantized
    config = {**plain, "weight_quantization": {"quantized_initialization": RULE}}
    with dsrun.zero.Init(config_dict_or_path=config):
        model = _gpt2()
    engine = dsrun.initialize(model=model, config=config)[0]
    quantized = {n: p for n, p in engine.module.named_parameters() if getattr(p, "weight_quantized", False)}
    assert set(quantized) == {"transformer.wte.weight", "transformer.wpe.weight"}  # lm_head is wte, tied
    state = dict(drawn)
    with dsrun.zero.GatheredParameters(list(quantized.values())):
        for name, p in quantized.items():
            state[name] = dequantized(p).detach().clone()
    for name in quantized:
        w = drawn[name].double().reshape(-1, RULE["group_size"])
        step = (w.amax(-1, keepdim=True) - w.amin(-1, keepdim=True)) / (2 ** RULE["num_bits"] - 1)
        error = (state[name].double().reshape(w.shape) - w).abs()
        # half a step, plus the fp32 rounding of (code * scale + min): a few ulp of the group's largest value
        assert (error <= step / 2 + 4 * torch.finfo(torch.float32).eps * w.abs().amax(-1, keepdim=True)).all(), name
        assert error.max() > 0, name
    state["lm_head.weight"] = state["transformer.wte.weight"]
    assert _outputs(engine, _reference(state)) == {"engine": True, "module": True, "generate": True}
    engine.destroy()


def _training_gpt2() -> nn.Module:
    """``_gpt2``'s model without dropout: its losses depend on the weights alone, not on the random stream."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                      eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _train(engine, ids: torch.Tensor, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("offload", [{}, {"offload_param": {"device": "cpu"}},
                                     {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}],
                         ids=["none", "param", "param+optimizer"])
def test_a_training_engine_generates_inside_unwrap_model_for_generation_and_trains_on_unchanged(offload):
    # TRL's RLHF loop: train, generate inside the block, train on. With offload_param the coordinator gathers (a world
    # of one otherwise keeps the parameters whole): the engine's forward inside the block used to start a pass that
    # released what the block gathered ('weight' must be 2-D)
    config = {**_config(**offload), "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    engine, twin = (dsrun.initialize(model=_training_gpt2(), config=config)[0] for _ in range(2))
    first = _train(engine, ids, 1)
    reference = _reference(dsrun.zero.full_state_dict(engine.module))  # the trained model, unpartitioned
    with torch.no_grad():
        tokens = reference.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        with dsrun.zero.unwrap_model_for_generation(engine):
            engine.eval()
            assert torch.equal(engine(input_ids=ids).logits, reference(ids).logits)
            assert torch.equal(engine.module.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0), tokens)
            engine.train()
            with torch.enable_grad():  # training inside the block too: the second forward reads the regathered weights
                first += _train(engine, ids, 2)
    # the block changed nothing the training sees: the same losses as an engine that never entered it
    assert first + _train(engine, ids, 1) == _train(twin, ids, 4)
    engine.destroy()
    twin.destroy()


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_one_and_two_without_an_optimizer_are_refused_as_deepspeed_asserts(stage):
    with pytest.raises(UserError, match=rf"zero_optimization.stage: stage {stage} .* needs an optimizer"):
        dsrun.initialize(model=nn.Linear(4, 4), config={"train_micro_batch_size_per_gpu": 1,
                                                        "zero_optimization": {"stage": stage}})


def test_a_scheduler_without_an_optimizer_is_refused_at_stage_three_too():
    # engine.optimizer is ZeRO-Inference's DeepSpeedZeRoOffload there, which no scheduler can step
    with pytest.raises(UserError, match="a scheduler needs an optimizer"):
        dsrun.initialize(model=nn.Linear(4, 4), config={**_config(), "scheduler": {"type": "WarmupLR"}})
