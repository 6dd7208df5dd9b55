"""Checkpoints cross over with DeepSpeed, both ways, on one rank in process (no DeepSpeed needed):

* dsrun's files carry what DeepSpeed 0.19's ``load_checkpoint`` reads (``ds_version`` inside the ZeRO optimizer
  state, its loss scaler written as a reference to DeepSpeed's class, stage 0's per-parameter torch state);
* a checkpoint laid out as DeepSpeed 0.19 writes it (built here from that layout, with its pickled
  ``LossScaler`` / ``ZeroStageEnum`` / ``fragment_address``) loads in dsrun and training continues exactly;
* any other pickled class is still refused.

``benchmarks/cross_checkpoint.py`` checks the same against a real DeepSpeed.
"""
from __future__ import annotations

import io
import pickletools
import zipfile
from collections import OrderedDict

import pytest
import torch

from dsrun.checkpoint import load_file
from dsrun.checkpoint.deepspeed_format import PICKLE_MODULE, ForeignObject
from dsrun.checkpoint.safe_load import UnsafeCheckpointError
from dsrun.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from tests.harness.runs import full_state as full_params

from .conftest import make_engine, train

pytestmark = pytest.mark.usefixtures("single_rank")

CONFIGS = [(stage, precision) for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16", "fp16")]
TORCH_ADAMW = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}}}
SCALER = ("deepspeed.runtime.fp16.loss_scaler", "LossScaler")


def pickled_globals(path) -> set[str]:
    with zipfile.ZipFile(path) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    return {arg.replace(" ", ".") for op, arg, _ in pickletools.genops(io.BytesIO(data)) if op.name == "GLOBAL"}


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:3])


def trained_params(engine) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters DeepSpeed's stage-0 torch optimizer holds, in its order (tied weights once)."""
    return [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]


def _scale_keys(engine) -> dict:
    """DeepSpeed's stage-0 wrapper loss-scale entries for this engine after 2 steps (bf16: a fixed 1)."""
    if engine.precision.name != "fp16":
        return {"dynamic_loss_scale": False, "cur_scale": 1.0, "cur_iter": 2}
    scaler = engine.precision.scaler
    return {"dynamic_loss_scale": True, "cur_scale": scaler.cur_scale, "cur_iter": 2, "last_overflow_iter": -1,
            "scale_factor": 2.0, "scale_window": 1000}


@pytest.mark.parametrize("stage,precision", CONFIGS + [(0, "fp16-torch-adam"), (0, "bf16-torch-adam")])
def test_dsrun_files_carry_what_deepspeed_reads(tmp_path, stage, precision):
    unfused = precision.endswith("-torch-adam")  # DeepSpeed wraps a torch optimizer in FP16_UnfusedOptimizer
    precision = precision.split("-")[0]
    engine = make_engine(stage, precision, extra=TORCH_ADAMW if unfused else None)
    train(engine, 2)
    engine.save_checkpoint(str(tmp_path))
    tag_dir = tmp_path / "global_step2"
    model_file = tag_dir / ("zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt")
    states = load_file(model_file)
    for key in ("module", "dp_world_size", "mp_world_size", "global_steps", "skipped_steps", "lr_scheduler",
                "ds_version"):  # what DeepSpeed's _load_checkpoint indexes
        assert key in states
    params = trained_params(engine)
    if stage == 0 and precision != "fp32" and not unfused:  # DeepSpeed's FP16_Optimizer: flat, as dsrun's own
        opt = states["optimizer"]
        assert opt["optimizer_state_dict"] == opt["base_optimizer_state"] and opt["clip_grad"] == 1.0
        assert all(torch.equal(a, b) for a, b in zip(opt["fp32_groups_flat"], opt["single_partition_of_fp32_groups"]))
        assert {k: opt[k] for k in _scale_keys(engine)} == _scale_keys(engine)
        return
    if stage == 0:
        opt = states["optimizer"]
        per_param = opt if precision == "fp32" else opt["optimizer_state_dict"]
        assert per_param["param_groups"][0]["params"] == list(range(len(params)))
        flat = opt["base_optimizer_state"]["state"][0]
        for key in ("exp_avg", "exp_avg_sq"):
            parts = [per_param["state"][i][key] for i in range(len(params))]
            assert [t.shape for t in parts] == [p.shape for _, p in params]
            assert torch.equal(torch.cat([t.reshape(-1) for t in parts]), flat[key][: sum(t.numel() for t in parts)])
        steps = [per_param["state"][i]["step"] for i in range(len(params))]
        assert all(torch.is_tensor(s) and s.dtype == torch.float32 and float(s) == 2 for s in steps)
        assert len({id(s) for s in steps}) == len(steps)  # one per parameter: torch's Adam adds to it in place
        if precision != "fp32":  # DeepSpeed's unfused wrapper: per-parameter fp32 masters, the loss scale
            assert [t.shape for t in opt["fp32_groups"][0]] == [p.shape for _, p in params]
            assert {k: opt[k] for k in _scale_keys(engine)} == _scale_keys(engine)
        return
    optim_file = tag_dir / f"{'bf16_' if precision == 'bf16' else ''}zero_pp_rank_0_mp_rank_00_optim_states.pt"
    inner = load_file(optim_file)["optimizer_state_dict"]
    assert version_tuple(inner["ds_version"]) >= (0, 3, 17)  # DeepSpeed asserts it is there and this recent
    scaler_class = "DynamicLossScaler" if precision == "fp16" else "LossScaler"
    assert f"deepspeed.runtime.fp16.loss_scaler.{scaler_class}" in pickled_globals(optim_file)  # DeepSpeed's class
    scaler = inner["loss_scaler"]
    if precision == "fp16":  # every attribute of DeepSpeed's dynamic scaler, from the engine's
        assert vars(scaler) == vars(engine.precision.scaler) and scaler.cur_iter == 2 and scaler.delayed_shift == 2
    else:
        assert (scaler.cur_scale, scaler.dynamic) == (1.0, False)
    assert (inner["dynamic_loss_scale"], inner["overflow"], inner["clip_grad"]) == (precision == "fp16", False, 1.0)
    assert inner["zero_stage"] == stage and inner["partition_count"] == 1
    masters = inner["fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"]
    base = inner["optimizer_state_dict" if stage == 3 else "base_optimizer_state"]
    total = sum(getattr(p, "ds_numel", p.numel()) for _, p in params)
    assert base["state"][0]["exp_avg"].numel() >= masters[0].numel() >= total > 0


# --- a checkpoint as DeepSpeed 0.19 lays it out -------------------------------------------------------------
def _split(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape in shapes:
        out.append(flat[offset: offset + shape.numel()].clone().view(shape))
        offset += shape.numel()
    return out


def _torch_state_per_param(flat_state: dict, hyper: dict, shapes: list[torch.Size]) -> dict:
    """torch.optim.AdamW's state_dict over the separate parameters (what DeepSpeed's stage 0 steps)."""
    split = {k: _split(v, shapes) for k, v in flat_state.items() if k != "step"}
    step = float(flat_state["step"])  # torch keeps it as a float32 tensor per parameter
    state = {i: {"step": torch.tensor(step), **{k: split[k][i] for k in split}} for i in range(len(shapes))}
    return {"state": state, "param_groups": [{**hyper, "params": list(range(len(shapes)))}]}


def write_deepspeed_checkpoint(engine, root, tag: str) -> None:
    """The files DeepSpeed 0.19.8 writes for this one-rank engine (model states, ZeRO optimizer states with its
    pickled classes, ``latest``), from the engine's live state; no dsrun-only key or file."""
    stage, bf16, fp16 = engine.zero_optimization_stage(), engine.bfloat16_enabled(), engine.fp16_enabled()
    sd = engine.strategy.state_dict()
    params = trained_params(engine)
    shapes = [p.shape for _, p in params]
    module = OrderedDict((k, v.detach().clone()) for k, v in engine.module.state_dict().items())
    ds_config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage}}
    states = {"module": module, "buffer_names": [], "optimizer": None,
              "param_shapes": None if stage == 0 else engine.strategy.checkpoint_param_shapes(),
              "frozen_param_shapes": OrderedDict() if stage == 3 else None, "shared_params": None,
              "frozen_param_fragments": OrderedDict() if stage == 3 else None,
              "lr_scheduler": {"last_batch_iteration": engine.lr_scheduler.last_batch_iteration},
              "data_sampler": None, "random_ltd": None, "skipped_steps": 0, "global_steps": engine.global_steps,
              "global_samples": engine.global_samples, "dp_world_size": 1, "mp_world_size": 1,
              "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1}, "ds_config": ds_config,
              "ds_version": "0.19.8"}
    if stage:  # (DeepSpeed's stage 0 records none)
        states["shared_params"] = {"lm_head.weight": "transformer.wte.weight"}
    scaler = ForeignObject(*SCALER, state={"cur_scale": 1.0, "dynamic": False}, newobj=True)
    if fp16:  # DeepSpeed's DynamicLossScaler with the attributes its constructor sets
        live = engine.precision.scaler
        scaler = ForeignObject(SCALER[0], "DynamicLossScaler", state={
            "cur_scale": live.cur_scale, "dynamic": True, "cur_iter": live.cur_iter, "last_overflow_iter": -1,
            "scale_factor": 2.0, "scale_window": 1000, "min_scale": 1, "delayed_shift": 2,
            "cur_hysteresis": live.cur_hysteresis, "consecutive_hysteresis": False, "raise_error_at_min_scale": True,
            "dtype": torch.float16}, newobj=True)
    zero_stage = ForeignObject("deepspeed.runtime.zero.config", "ZeroStageEnum", args=(stage,))
    hyper = {k: v for k, v in sd["base_optimizer_state"]["param_groups"][0].items() if k != "params"} if stage < 3 \
        else None
    if stage == 0:
        per_param = _torch_state_per_param(sd["base_optimizer_state"]["state"][0], hyper, shapes)
        if fp16:  # DeepSpeed's FP16_Optimizer around its FusedAdam: one flat fp32 master and state per group
            states["optimizer"] = {**_scale_keys(engine), "optimizer_state_dict": sd["base_optimizer_state"],
                                   "fp32_groups_flat": sd["single_partition_of_fp32_groups"], "clip_grad": 1.0}
        elif bf16:  # DeepSpeed's unfused bf16 wrapper around the torch optimizer
            states["optimizer"] = {"dynamic_loss_scale": False, "cur_scale": 1.0, "cur_iter": engine.global_steps,
                                   "optimizer_state_dict": per_param,
                                   "fp32_groups": [_split(sd["single_partition_of_fp32_groups"][0], shapes)]}
        else:  # the torch optimizer itself; the fp32 weights are the module's
            states["optimizer"] = per_param
    elif stage in (1, 2):
        offsets, mappings = 0, OrderedDict()
        for name, p in params:
            mappings[name] = ForeignObject("deepspeed.utils.tensor_fragment", "fragment_address",
                                           state={"numel": p.numel(), "start": offsets}, newobj=True)
            offsets += p.numel()
        inner = {"loss_scaler": scaler, "dynamic_loss_scale": fp16, "overflow": False, "clip_grad": 1.0,
                 "base_optimizer_state": sd["base_optimizer_state"],
                 "single_partition_of_fp32_groups": sd["single_partition_of_fp32_groups"], "zero_stage": zero_stage,
                 "group_paddings": sd["group_paddings"], "param_alignment_paddings": [[0] * len(params)],
                 "partition_count": [1], "ds_version": "0.19.8", "param_slice_mappings": [mappings]}
    else:
        inner = {"zero_stage": zero_stage, "loss_scaler": scaler, "dynamic_loss_scale": fp16, "overflow": False,
                 "partition_count": 1, "optimizer_state_dict": sd["optimizer_state_dict"],
                 "fp32_flat_groups": sd["fp32_flat_groups"]}
        states["module"] = OrderedDict((k, torch.empty(0, dtype=v.dtype)) for k, v in module.items())
    tag_dir = root / tag
    tag_dir.mkdir(parents=True)
    model_name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    torch.save(states, tag_dir / model_name)
    if stage:
        optim = {"optimizer_state_dict": inner, "ds_config": ds_config, "ds_version": "0.19.8"}
        name = f"{'bf16_' if bf16 else ''}zero_pp_rank_0_mp_rank_00_optim_states.pt"
        torch.save(optim, tag_dir / name, pickle_module=PICKLE_MODULE)
        assert {f"deepspeed.runtime.fp16.loss_scaler.{'DynamicLossScaler' if fp16 else 'LossScaler'}",
                "deepspeed.runtime.zero.config.ZeroStageEnum"} <= pickled_globals(tag_dir / name)
    (root / "latest").write_text(tag)


@pytest.mark.parametrize("stage,precision", CONFIGS)
def test_deepspeed_checkpoint_loads_and_training_continues(tmp_path, stage, precision):
    engine = make_engine(stage, precision)
    train(engine, 2)
    write_deepspeed_checkpoint(engine, tmp_path, "global_step2")
    if stage:  # zero_to_fp32 reads DeepSpeed's files too: its fp32 weights round to the model's own
        weights, dtype = full_params(engine), torch.bfloat16 if precision == "bf16" else torch.float32
        masters = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
        assert set(masters) == set(weights)
        assert all(torch.equal(masters[k].to(dtype).float(), weights[k]) for k in weights)
    expected = train(engine, 2, start=2)

    fresh = make_engine(stage, precision)
    path, client = fresh.load_checkpoint(str(tmp_path))
    assert path is not None and (fresh.global_steps, fresh.global_samples) == (2, 8)
    assert "checkpoint_parallel_dimensions" in client  # DeepSpeed's own extra key comes back as client state
    assert train(fresh, 2, start=2) == expected  # weights, Adam moments and LR schedule all restored, exactly
    if precision == "fp16":  # and the loss scale's schedule
        assert fresh.precision.scaler.state_dict() == engine.precision.scaler.state_dict()


def test_other_pickled_classes_are_still_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"x": ForeignObject("deepspeed.runtime.engine", "DeepSpeedEngine", newobj=True)}, path,
               pickle_module=PICKLE_MODULE)
    with pytest.raises(UnsafeCheckpointError, match="allow-list"):
        load_file(path)
