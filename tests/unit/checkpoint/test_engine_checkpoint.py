"""Save/load on one rank, in process: files and keys, exact resume, load options, 16-bit export, zero_to_fp32."""
from __future__ import annotations

import pytest
import torch

from dsrun.checkpoint import DS_KEYS, load_file, partial_state, read_latest, tensor_file
from dsrun.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from tests.harness.runs import LR

from .conftest import make_engine, train

pytestmark = pytest.mark.usefixtures("single_rank")


@pytest.mark.parametrize("stage,precision", [(0, "fp32"), (1, "bf16"), (2, "fp32"), (3, "bf16")])
def test_layout_and_keys(tmp_path, stage, precision):
    engine = make_engine(stage, precision)
    train(engine, 2)
    assert engine.save_checkpoint(str(tmp_path), client_state={"epoch": 3}) is True
    assert (tmp_path / "latest").read_bytes() == b"global_step2"  # the tag, no newline
    assert (tmp_path / "zero_to_fp32.py").stat().st_mode & 0o111
    tag_dir = tmp_path / "global_step2"
    names = sorted(p.name for p in tag_dir.iterdir())
    optim = [f"{'bf16_' if precision == 'bf16' else ''}zero_pp_rank_0_mp_rank_00_optim_states.pt"] if stage else []
    model_file = "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    assert names == sorted([model_file, "rng_states_rank_0.pt", *optim])
    states = load_file(tag_dir / model_file)
    for key in ("module", "buffer_names", "optimizer", "param_shapes", "shared_params", "lr_scheduler",
                "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
                "ds_version"):
        assert key in states
    assert states["epoch"] == 3 and states["global_steps"] == 2 and states["global_samples"] == 8
    assert states["shared_params"] == {"lm_head.weight": "transformer.wte.weight"}
    assert list(states["param_shapes"][0])[0] == "transformer.wte.weight"
    assert (states["optimizer"] is not None) == (stage == 0)
    if stage:
        inner = load_file(tag_dir / optim[0])["optimizer_state_dict"]
        keys = (("optimizer_state_dict", "fp32_flat_groups") if stage == 3 else
                ("base_optimizer_state", "single_partition_of_fp32_groups", "group_paddings"))
        for key in ("zero_stage", "partition_count", *keys):
            assert key in inner
        assert inner["zero_stage"] == stage
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no staging left behind


def test_resume_restores_everything(tmp_path, monkeypatch):
    """Bitwise; the module read straight into the live module's tensors, each saved byte once."""
    engine = make_engine(2, "fp32", dropout=0.1)
    train(engine, 3)
    engine.save_checkpoint(str(tmp_path), client_state={"data": {"step": 3}})
    expected = train(engine, 3, start=3)
    lr_after, steps_after = engine.get_lr(), engine.global_steps

    fresh = make_engine(2, "fp32", dropout=0.1)
    torch.manual_seed(999)  # a different RNG state that the load must overwrite
    handed = []  # what load_state_dict gets: the live tensors themselves, read in place (no second module copy)
    monkeypatch.setattr(partial_state, "read_module_into",
                        lambda *a, into=partial_state.read_module_into: handed.append(into(*a)) or handed[-1])
    stats = tensor_file.reset_read_stats()
    path, client = fresh.load_checkpoint(str(tmp_path))
    live = fresh.module.state_dict(keep_vars=True)
    assert handed and all(handed[0][k] is live[k] for k in live)
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in live.values()}  # the tied head read once
    assert stats.module_bytes == sum(unique.values()) and stats.range_bytes == stats.whole_files == 0
    assert path.endswith("global_step3/mp_rank_00_model_states.pt")
    assert client == {"data": {"step": 3}} and not set(client) & DS_KEYS
    assert (fresh.global_steps, fresh.global_samples, fresh.micro_steps) == (3, 12, 3)
    assert train(fresh, 3, start=3) == expected  # bitwise: weights, Adam moments, LR schedule, dropout RNG
    assert fresh.get_lr() == lr_after and fresh.global_steps == steps_after


@pytest.mark.parametrize("stage,torch_adam", [(1, True), (2, False)])
def test_elastic_checkpoint_switches_the_optimizer_layout_and_either_resumes_bit_exactly(tmp_path, stage, torch_adam):
    """zero_optimization.elastic_checkpoint: on, the optimizer state is DeepSpeed's elastic layout (a list of
    per-group states, the step count beside it); off, the torch optimizer's state dict. A run with the other
    setting loads either and continues bit for bit (the multi-rank reshard: test_checkpoint_reshard.py). torch's
    AdamW keeps its step as a tensor, dsrun's CPU Adam as an int: both cross."""
    layouts = {}
    optimizer = {"optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": torch_adam}}}
    for elastic in (False, True):
        engine = make_engine(stage, zero={"elastic_checkpoint": elastic}, extra=optimizer)
        train(engine, 2)
        engine.save_checkpoint(str(tmp_path / str(elastic)))
        expected = train(engine, 2, start=2)
        sd = load_file(tmp_path / str(elastic) / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        base = sd["optimizer_state_dict"]["base_optimizer_state"]
        layouts[elastic] = (type(base).__name__, sd["optimizer_state_dict"].get("base_optimizer_state_step"))
        state = base[0] if elastic else base["state"][0]
        assert state["exp_avg"].shape == sd["optimizer_state_dict"]["single_partition_of_fp32_groups"][0].shape
        fresh = make_engine(stage, zero={"elastic_checkpoint": not elastic}, extra=optimizer)
        fresh.load_checkpoint(str(tmp_path / str(elastic)))
        assert train(fresh, 2, start=2) == expected and fresh.get_lr() == engine.get_lr()
    assert layouts == {False: ("dict", None), True: ("list", 2)}


def test_load_without_latest_returns_none(tmp_path, capsys):
    engine = make_engine(1)
    assert engine.load_checkpoint(str(tmp_path)) == (None, None)
    assert "Unable to find latest file" in capsys.readouterr().out


def test_load_missing_tag_names_the_folder(tmp_path):
    engine = make_engine(1)
    with pytest.raises(FileNotFoundError, match="global_step7"):
        engine.load_checkpoint(str(tmp_path), tag="global_step7")


def test_bad_tag_is_a_user_error(tmp_path):
    from dsrun.utils.errors import UserError

    engine = make_engine(1)
    with pytest.raises(UserError, match="save_checkpoint\\(tag=...\\)"):
        engine.save_checkpoint(str(tmp_path), tag="../escape")


def test_load_module_only_keeps_fresh_optimizer_and_counters(tmp_path):
    engine = make_engine(1)
    train(engine, 3)
    engine.save_checkpoint(str(tmp_path))
    weights = {k: v.clone() for k, v in engine.module.state_dict().items()}
    fresh = make_engine(1)
    fresh.load_checkpoint(str(tmp_path), load_module_only=True)
    assert fresh.global_steps == 0 and not fresh.optimizer.state
    for key, value in fresh.module.state_dict().items():
        assert torch.equal(value, weights[key])
    # the master weights were refreshed too: one more step starts from the loaded weights
    train(fresh, 1)
    assert all(torch.isfinite(v).all() for v in fresh.module.state_dict().values())


def test_resave_same_tag_replaces_it(tmp_path):
    engine = make_engine(1)
    train(engine, 1)
    engine.save_checkpoint(str(tmp_path), tag="best")
    train(engine, 2)
    engine.save_checkpoint(str(tmp_path), tag="best")
    assert read_latest(tmp_path) == "best"
    assert load_file(tmp_path / "best" / "mp_rank_00_model_states.pt")["global_steps"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "latest", "zero_to_fp32.py"]


@pytest.mark.parametrize("stage,precision", [(0, "fp32"), (0, "bf16"), (1, "fp32"), (2, "bf16"), (3, "fp32"),
                                             (3, "bf16")])
def test_zero_to_fp32_equals_live_model(tmp_path, stage, precision):
    from tests.harness.runs import full_state as full_params

    engine = make_engine(stage, precision, frozen=True)  # a frozen parameter too
    train(engine, 2)
    engine.save_checkpoint(str(tmp_path))
    sd = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    live = {k: v.to(engine.precision.model_dtype) for k, v in full_params(engine).items()}
    assert list(sd) == list(live)  # same keys, same order, the tied alias included
    assert sd["lm_head.weight"] is sd["transformer.wte.weight"]
    for key, value in live.items():
        assert sd[key].dtype == torch.float32
        if precision == "fp32":
            assert torch.equal(sd[key], value), key
        else:  # the fp32 masters, rounded as the model holds them
            assert torch.equal(sd[key].to(value.dtype), value), key


def test_save_16bit_model(tmp_path):
    engine = make_engine(2, "bf16")
    train(engine, 1)
    assert engine.save_16bit_model(str(tmp_path)) is True
    sd = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    live = engine.module.state_dict()
    assert list(sd) == list(live)
    assert all(torch.equal(sd[k], live[k]) and sd[k].dtype == torch.bfloat16 for k in live)
    assert sd["lm_head.weight"].data_ptr() == sd["transformer.wte.weight"].data_ptr()  # stored once


@pytest.mark.parametrize("saved_stage,new_stage", [(1, 2), (2, 0), (0, 3), (3, 1)])
def test_load_into_another_stage_continues_training(tmp_path, capsys, saved_stage, new_stage):
    engine = make_engine(saved_stage)
    train(engine, 3)
    engine.save_checkpoint(str(tmp_path))
    expected = train(engine, 2, start=3)
    other = make_engine(new_stage)
    other.load_checkpoint(str(tmp_path))
    assert f"saved by 1 rank(s) at ZeRO stage {saved_stage}, loading into 1 rank(s) at stage {new_stage}" in capsys.readouterr().out
    assert other.global_steps == 3
    assert train(other, 2, start=3) == pytest.approx(expected, rel=1e-6)  # Adam moments moved across layouts


def test_load_universal_goes_through_the_reshard_path(tmp_path, capsys):
    engine = make_engine(2)
    train(engine, 2)
    engine.save_checkpoint(str(tmp_path))
    expected = train(engine, 2, start=2)
    fresh = make_engine(2, extra={"checkpoint": {"load_universal": True}})
    fresh.load_checkpoint(str(tmp_path))
    assert "resharding checkpoint global_step2" in capsys.readouterr().out
    assert train(fresh, 2, start=2) == expected  # same layout: the round trip is exact


def test_stage3_checkpoint_loads_into_an_engine_without_optimizer(tmp_path):
    import dsrun
    from tests.harness.models import checkpoint_gpt
    from tests.harness.runs import checkpoint_config
    from tests.harness.runs import full_state as full_params

    engine = make_engine(3)
    train(engine, 1)
    engine.save_checkpoint(str(tmp_path))
    cfg = checkpoint_config(0, "fp32", 4)
    del cfg["optimizer"], cfg["scheduler"]
    bare, *_ = dsrun.initialize(model=checkpoint_gpt(0.0), config=cfg)
    bare.load_checkpoint(str(tmp_path))
    want = full_params(engine)
    assert all(torch.equal(v, want[k]) for k, v in bare.module.state_dict().items())


def test_fp16_loss_scaler_state_is_restored(tmp_path):
    extra = {"fp16": {"enabled": True, "initial_scale_power": 40, "loss_scale_window": 2, "hysteresis": 2}}
    engine = make_engine(1, extra=extra)
    train(engine, 4)  # 2^40 overflows: some steps are skipped and the scale shrinks
    assert engine.skipped_steps > 0
    engine.save_checkpoint(str(tmp_path))
    scaler, skipped = dict(engine.precision.scaler.state_dict()), engine.skipped_steps
    expected = train(engine, 3, start=4)
    fresh = make_engine(1, extra=extra)
    fresh.load_checkpoint(str(tmp_path))
    assert fresh.precision.scaler.state_dict() == scaler and fresh.skipped_steps == skipped
    assert train(fresh, 3, start=4) == expected


def test_clone_tensors_for_torch_save_drops_shared_storage(tmp_path):
    from dsrun.checkpoint import clone_tensors_for_torch_save

    flat = torch.arange(10_000, dtype=torch.float32)
    item = {"a": [flat[:3], (flat[3:5], 7)], "b": "x"}
    cloned = clone_tensors_for_torch_save(item)
    assert torch.equal(cloned["a"][0], flat[:3]) and cloned["a"][1][1] == 7 and cloned["b"] == "x"
    torch.save(item, tmp_path / "view.pt")
    torch.save(cloned, tmp_path / "clone.pt")
    assert (tmp_path / "clone.pt").stat().st_size < (tmp_path / "view.pt").stat().st_size / 10


@pytest.mark.parametrize("folder", ["", None, "  "])
def test_an_empty_checkpoint_folder_is_a_value_error(tmp_path, monkeypatch, folder):
    """DeepSpeed's save_checkpoint(save_dir="") must fail at once on every rank, not hang or write to the cwd."""
    monkeypatch.chdir(tmp_path)
    engine = make_engine(1)
    with pytest.raises(ValueError, match="save_dir"):
        engine.save_checkpoint(folder)
    with pytest.raises(ValueError, match="load_dir"):
        engine.load_checkpoint(folder)
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_serialization_false_writes_the_legacy_format_and_resumes(tmp_path):
    """checkpoint.checkpoint_serialization false: torch.save's pre-zipfile format for every file, as DeepSpeed's
    checkpoint engine writes it; the checkpoint loads back exactly, and into ZeRO-2 as the zip files do."""
    import zipfile

    formats, resharded_losses = [], []
    for serialization in (True, False):
        folder = tmp_path / str(serialization)
        engine = make_engine(1, extra={"checkpoint": {"checkpoint_serialization": serialization}})
        train(engine, 2)
        engine.save_checkpoint(str(folder))
        formats.append({zipfile.is_zipfile(p) for p in (folder / "global_step2").iterdir()})
        expected = train(engine, 2, start=2)
        fresh = make_engine(1)
        fresh.load_checkpoint(str(folder))
        assert train(fresh, 2, start=2) == expected
        resharded = make_engine(2)  # stage 1 -> 2: the legacy files read by range (tensor_file.legacy_index)
        resharded.load_checkpoint(str(folder))
        resharded_losses.append(train(resharded, 2, start=2))
    assert formats == [{True}, {False}]
    assert resharded_losses[0] == resharded_losses[1]  # bitwise: the same state from either format


@pytest.mark.parametrize("stage", [1, 3])
def test_load_from_fp32_weights_false_rebuilds_the_masters_from_the_16bit_weights(tmp_path, stage):
    """zero_optimization.load_from_fp32_weights (default true) loads the saved fp32 masters; false rebuilds them
    from the bf16 weights loaded into the model (DeepSpeed's _restore_from_bit16_weights)."""
    import dsrun
    from dsrun.utils import safe_get_full_fp32_param
    from tests.harness.models import checkpoint_gpt
    from tests.harness.runs import checkpoint_config

    def bf16_engine(from_fp32: bool):
        model = checkpoint_gpt(0.0)
        config = checkpoint_config(stage, "bf16", 4, zero={"load_from_fp32_weights": from_fp32})
        return dsrun.initialize(model=model, config=config)[0]

    engine = bf16_engine(True)
    train(engine, 3)
    engine.save_checkpoint(str(tmp_path))
    saved = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    masters = {}
    for from_fp32 in (True, False):
        fresh = bf16_engine(from_fp32)
        fresh.load_checkpoint(str(tmp_path))
        masters[from_fp32] = {n: safe_get_full_fp32_param(p) for n, p in fresh.module.named_parameters()}
    rounded = {n: v.bfloat16().float() for n, v in saved.items()}  # what the bf16 model weights hold
    assert all(torch.equal(masters[True][n], saved[n]) for n in saved)
    assert all(torch.equal(masters[False][n], rounded[n]) for n in saved)
    assert any(not torch.equal(saved[n], rounded[n]) for n in saved)  # the two differ: the key decided
