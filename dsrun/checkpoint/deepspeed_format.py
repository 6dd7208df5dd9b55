"""DeepSpeed's own checkpoint files, both ways: what dsrun adds so DeepSpeed's ``load_checkpoint`` takes a dsrun
checkpoint, and how dsrun reads one that DeepSpeed wrote.

**Writing (dsrun -> DeepSpeed).** dsrun's files already follow DeepSpeed's layout (file names, the model-states
keys, ``single_partition_of_fp32_groups`` / ``base_optimizer_state`` / ``fp32_flat_groups`` ...). What DeepSpeed
also reads, and dsrun adds here:

* in every ZeRO optimizer state (stages 1-3, ``optimizer_state_dict`` of ``*_optim_states.pt``): ``ds_version``
  (DeepSpeed asserts it is there), ``loss_scaler`` (an object of DeepSpeed's class
  ``deepspeed.runtime.fp16.loss_scaler.LossScaler``, or with fp16 the engine's ``DynamicLossScaler`` /
  ``LossScaler`` with all its attributes: stage 3 calls its methods), ``dynamic_loss_scale``,
  ``overflow`` and ``clip_grad``;
* at stage 0 (the optimizer inside ``mp_rank_00_model_states.pt``), beside dsrun's flat state: fp32, the torch
  optimizer's own per-parameter ``state`` / ``param_groups`` (DeepSpeed steps the client optimizer directly);
  fp16 and bf16, the keys of the wrapper DeepSpeed would use (``FP16_Optimizer``: ``fp32_groups_flat`` and the
  flat state; ``FP16_UnfusedOptimizer``: per-parameter ``optimizer_state_dict`` and ``fp32_groups``), with the
  loss scale (``cur_scale``, ``cur_iter``, and for a dynamic scale ``last_overflow_iter``, ``scale_factor``,
  ``scale_window``) and ``clip_grad``.
  The per-parameter tensors are views of the flat ones, so the file holds their elements once.

The loss scaler is written as a reference to DeepSpeed's class by name (:class:`_Pickler`), so writing needs no
DeepSpeed; DeepSpeed builds its own object when it reads the file.

**Reading (DeepSpeed -> dsrun).** DeepSpeed's files pickle a few of its classes (the loss scaler,
``ZeroStageEnum``, ``fragment_address``). They stay behind ``torch.load(weights_only=True)``: each is mapped, by
its full name, to a plain stand-in (``zero_to_fp32.DEEPSPEED_GLOBALS``, which the standalone converter shares),
never imported or run. :func:`to_dsrun` then turns
a DeepSpeed optimizer state into the one dsrun's ZeRO strategies load, the loss scale included. (Under the ``deepspeed`` alias, a plain
``torch.load(path, weights_only=False)`` of either side's files builds dsrun's own scaler classes,
:mod:`dsrun.precision.loss_scaler`; dsrun's loaders never unpickle them and keep to the stand-ins.)
"""
from __future__ import annotations

import os
import pickle
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from dsrun.utils.zero_to_fp32 import PickledObject, alignment_paddings

from .safe_load import load_file

if TYPE_CHECKING:
    from dsrun.precision.loss_scaler import LossScalerBase

Shape = Sequence[int]  # a torch.Size, or the list a JSON-like state holds

VERSION = "0.19.8"  # the DeepSpeed release whose checkpoint reader these files were checked against
_LOSS_SCALER_MODULE = "deepspeed.runtime.fp16.loss_scaler"
ELASTIC_STEP = "base_optimizer_state_step"  # the step count of an elastic layout (:func:`elastic_layout`)
ELASTIC_GROUPS = "base_optimizer_param_groups"  # its param groups' hyper-parameters (dsrun's; DeepSpeed has none)


# --- writing objects of DeepSpeed's classes without DeepSpeed ----------------------------------------------
@dataclass
class ForeignObject:
    """An object of the class ``module.name`` (not importable here), built at load time as ``cls(*args)`` (or,
    with ``newobj``, ``cls.__new__(cls)``) with ``state`` (if any) set on it."""

    module: str
    name: str
    state: dict[str, Any] | None = None
    args: tuple = ()
    newobj: bool = False


class _Pickler(pickle._Pickler):  # the Python pickler: its save() can write a class reference by name
    def save(self, obj: object, save_persistent_id: bool = True) -> None:
        if type(obj) is ForeignObject:
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
            self.save(tuple(obj.args))
            self.write(pickle.NEWOBJ if obj.newobj else pickle.REDUCE)
            if obj.state is not None:
                self.save(obj.state)
                self.write(pickle.BUILD)
            return
        super().save(obj, save_persistent_id)


PICKLE_MODULE = types.SimpleNamespace(__name__="dsrun_deepspeed_pickle", Pickler=_Pickler, dump=pickle.dump)


def holds_foreign(obj: object) -> bool:  # obj: any value to be pickled
    if type(obj) is ForeignObject:
        return True
    if isinstance(obj, dict):
        return any(holds_foreign(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(holds_foreign(v) for v in obj)
    return False


# --- dsrun -> DeepSpeed ----------------------------------------------------------------------------------
def _scaler_object(scaler: LossScalerBase | None = None) -> ForeignObject:
    """The engine's loss scaler (dsrun's objects are DeepSpeed's classes, :mod:`dsrun.precision.loss_scaler`)
    as an object of DeepSpeed's class with the same attributes; None: the fixed scale 1 of fp32 and bf16."""
    if scaler is None:
        return ForeignObject(_LOSS_SCALER_MODULE, "LossScaler", {"cur_scale": 1.0, "dynamic": False}, newobj=True)
    return ForeignObject(_LOSS_SCALER_MODULE, type(scaler).__name__, dict(vars(scaler)), newobj=True)


def zero_state_for_deepspeed(sd: dict[str, Any], precision: str, clip_grad: float, scaler: LossScalerBase | None = None,
                             elastic: bool = False) -> dict[str, Any]:
    """A stage 1-3 strategy state with the keys DeepSpeed's ZeRO optimizers read added; ``scaler``: the fp16
    engine's loss scaler (dsrun reads its own state back from the same object); ``elastic``
    (``zero_optimization.elastic_checkpoint``): stages 1-2 write the optimizer state in DeepSpeed's elastic
    layout (:func:`elastic_layout`)."""
    out = elastic_layout(sd) if elastic and "single_partition_of_fp32_groups" in sd else dict(sd)
    out.update(ds_version=VERSION, loss_scaler=_scaler_object(scaler if precision == "fp16" else None),
               dynamic_loss_scale=bool(precision == "fp16" and scaler is not None and scaler.dynamic),
               clip_grad=float(clip_grad))
    out.setdefault("overflow", False)
    return out


def elastic_layout(sd: dict[str, Any]) -> dict[str, Any]:
    """A stage 1-2 strategy state in DeepSpeed's elastic layout (``zero_optimization.elastic_checkpoint``):
    ``base_optimizer_state`` is a list, one entry per param group holding the state of its flat master with the
    partition's padding (the last rank's) cut off, so the saved ranks' entries put end to end are the group's
    whole state, which a load at any world size re-cuts. ``base_optimizer_state_step`` is the step count:
    DeepSpeed writes it only when its optimizer keeps the step in its param groups (FusedAdam) but its elastic
    load asserts it is there, so it is written whatever the optimizer. The layout has no place for the param
    groups' hyper-parameters (a WarmupLR's current lr): dsrun adds them as ``base_optimizer_param_groups``,
    which DeepSpeed does not read (docs/checkpoint.md)."""
    base, paddings = sd["base_optimizer_state"], sd["group_paddings"]
    groups = []
    for gi, group in enumerate(base["param_groups"]):
        state = base["state"].get(group["params"][0], {})  # stages 1-2: one flat master per param group
        groups.append({k: v[:v.numel() - paddings[gi]] if torch.is_tensor(v) and v.dim() > 0 else v
                       for k, v in state.items()})
    step = next((int(s["step"]) for s in groups if "step" in s), 0)
    hyper = [{k: v for k, v in group.items() if k != "params"} for group in base["param_groups"]]
    return {**sd, "base_optimizer_state": groups, ELASTIC_STEP: step, ELASTIC_GROUPS: hyper}


def _rigid(groups: list[dict[str, Any]], step: int | None, hyper: list[dict[str, Any]] | None) -> dict[str, Any]:
    """An elastic ``base_optimizer_state`` (:func:`elastic_layout`) as the torch optimizer state dsrun reads: the
    per-element states stay as saved (the last rank's unpadded; the readers take either length), a step count
    kept only in ``base_optimizer_state_step`` (DeepSpeed's FusedAdam) joins each group's state, and the param
    groups carry the hyper-parameters dsrun saved beside them; DeepSpeed saves none, and then a load keeps the
    live ones, as DeepSpeed's elastic load does."""
    state = {gi: ({**s, "step": int(step)} if s and "step" not in s and step is not None else dict(s))
             for gi, s in enumerate(groups)}
    hyper = hyper if hyper is not None and len(hyper) == len(groups) else [{} for _ in groups]
    return {"state": state, "param_groups": [{**h, "params": [gi]} for gi, h in enumerate(hyper)]}


def _scale_keys(scaler: LossScalerBase | None, steps: int) -> dict[str, Any]:
    """The loss-scale entries of DeepSpeed's stage-0 fp16/bf16 wrappers (bf16: a fixed scale of 1)."""
    if scaler is None or not scaler.dynamic:
        return {"dynamic_loss_scale": False, "cur_scale": float(scaler.cur_scale if scaler else 1.0),
                "cur_iter": int(steps)}
    return {"dynamic_loss_scale": True, "cur_scale": scaler.cur_scale, "cur_iter": scaler.cur_iter,
            "last_overflow_iter": scaler.last_overflow_iter, "scale_factor": scaler.scale_factor,
            "scale_window": scaler.scale_window}


def _split(flat: torch.Tensor, shapes: Sequence[Shape]) -> list[torch.Tensor]:
    """Views of ``flat``'s leading elements, one per shape."""
    views, offset = [], 0
    for shape in shapes:
        numel = int(torch.Size(shape).numel())
        views.append(flat[offset: offset + numel].view(shape))
        offset += numel
    return views


def _scalar(key: str, value: torch.Tensor | float) -> torch.Tensor | float:
    """A per-parameter copy of a scalar state entry; the step count as its own float32 tensor, as torch's Adam
    keeps it (and adds to it in place)."""
    if key == "step":
        return torch.tensor(float(value), dtype=torch.float32)
    return value.clone() if torch.is_tensor(value) else value


def _per_parameter(base: dict[str, Any], group_shapes: list[list[Shape]]) -> dict[str, Any]:
    """A torch optimizer state over one flat tensor per group, as the same optimizer's state over the separate
    parameters (ids numbered across groups, as ``Optimizer.state_dict`` does); views, not copies."""
    state, groups, next_id = {}, [], 0
    for group, shapes in zip(base["param_groups"], group_shapes):
        ids = list(range(next_id, next_id + len(shapes)))
        next_id += len(shapes)
        flat_state = base["state"].get(group["params"][0], {}) if group["params"] else {}
        split = {k: _split(v, shapes) for k, v in flat_state.items() if torch.is_tensor(v) and v.dim() == 1}
        for i, pid in enumerate(ids):
            if flat_state:
                state[pid] = {k: split[k][i] if k in split else _scalar(k, v) for k, v in flat_state.items()}
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def stage0_for_deepspeed(sd: dict[str, Any], precision: str, steps: int, wrapper: str | None = None,
                         scaler: LossScalerBase | None = None, clip_grad: float = 0.0) -> dict[str, Any]:
    """A stage-0 strategy state with what DeepSpeed's stage 0 reads added. fp32: DeepSpeed steps the torch
    optimizer over the separate parameters, whose ``state`` / ``param_groups`` go at the top. fp16 and bf16:
    the keys of the wrapper DeepSpeed puts around it (``wrapper``, as
    :func:`dsrun.optim.optimizer_wrappers.wrapper_name` names it): ``FP16_Optimizer`` steps one flat fp32
    master per group, as dsrun does (``fp32_groups_flat`` and dsrun's own optimizer state),
    ``FP16_UnfusedOptimizer`` the separate parameters (per-parameter ``fp32_groups`` and state); both with the
    loss scale of ``scaler`` (fp16) or a fixed 1 (bf16). With no wrapper named, fp16/bf16 is left as it is."""
    out = dict(sd)
    if precision != "fp32" and wrapper not in ("FP16_Optimizer", "FP16_UnfusedOptimizer"):
        return out
    if wrapper == "FP16_Optimizer":
        out.update(_scale_keys(scaler, steps), optimizer_state_dict=sd["base_optimizer_state"],
                   fp32_groups_flat=sd["single_partition_of_fp32_groups"], clip_grad=float(clip_grad))
        return out
    per_parameter = _per_parameter(sd["base_optimizer_state"], sd["param_shapes"])
    if precision == "fp32":
        out.update(per_parameter)
    else:
        masters = [_split(m, shapes) for m, shapes in zip(sd["single_partition_of_fp32_groups"], sd["param_shapes"])]
        out.update(_scale_keys(scaler, steps), optimizer_state_dict=per_parameter, fp32_groups=masters,
                   clip_grad=float(clip_grad))
    return out


# --- DeepSpeed -> dsrun ----------------------------------------------------------------------------------
def _scaler_state(scaler: PickledObject | dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's pickled loss scaler as dsrun's loss-scaler state dict."""
    if not isinstance(scaler, PickledObject):
        return scaler
    if getattr(scaler, "dynamic", False):
        keys = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
        return {k: getattr(scaler, k) for k in keys if hasattr(scaler, k)}
    return {"cur_scale": float(getattr(scaler, "cur_scale", 1.0))}


def is_deepspeed_stage0(sd: object) -> bool:  # sd: whatever an optimizer-states file held
    return isinstance(sd, dict) and "zero_stage" not in sd and any(
        k in sd for k in ("param_groups", "fp32_groups", "fp32_groups_flat"))


def load_zero_state(path: str | os.PathLike) -> dict[str, Any]:
    """The ZeRO state in a stage 1-3 optimizer-states file, DeepSpeed's or dsrun's, as dsrun's strategies load it."""
    return to_dsrun(load_file(path)["optimizer_state_dict"])


def to_dsrun(sd: dict[str, Any]) -> dict[str, Any]:
    """A stage 1-3 ZeRO optimizer state that DeepSpeed (or dsrun) wrote, as dsrun's strategies load it; one in
    the elastic layout is marked ``elastic`` (:func:`dsrun.checkpoint.reshard.loads_as_saved`: it is re-cut)."""
    out = {k: v for k, v in sd.items() if k not in ("param_slice_mappings", "ds_version", ELASTIC_STEP, ELASTIC_GROUPS)}
    if isinstance(out.get("base_optimizer_state"), list):  # DeepSpeed's elastic layout
        out.update(base_optimizer_state=_rigid(out["base_optimizer_state"], sd.get(ELASTIC_STEP),
                                               sd.get(ELASTIC_GROUPS)), elastic=True)
    if isinstance(out.get("zero_stage"), int):
        out["zero_stage"] = int(out["zero_stage"])
    count = out.get("partition_count")
    if isinstance(count, (list, tuple)):
        out["partition_count"] = max(int(c) for c in count)
    if isinstance(out.get("loss_scaler"), PickledObject):
        out["loss_scaler"] = _scaler_state(out["loss_scaler"])
    # zero_optimization.parameter_alignment's gaps between parameters; DeepSpeed writes the key (all zeros) even
    # without it, dsrun only with it: a layout without gaps is the packed one either way
    paddings = alignment_paddings(out.pop("param_alignment_paddings", None))
    if paddings is not None:
        out["param_alignment_paddings"] = paddings
    return out


@dataclass
class Stage0Parameter:
    """Where DeepSpeed's stage-0 optimizer state keeps one parameter's elements: its fp32 master and per-element
    optimizer states (``moments``) hold them from element ``offset`` of each, flattened (a fused wrapper's flat
    group tensors; 0 for the separate parameters' own tensors)."""

    name: str
    numel: int
    master: torch.Tensor
    moments: dict[str, torch.Tensor]
    offset: int = 0


@dataclass
class Stage0Group:
    """One optimizer group of DeepSpeed's stage-0 state: its hyper-parameters (without ``params``), its other
    optimizer state (``step``: the first parameter's) and its parameters in order; ``stepped``: whether it has
    optimizer state (DeepSpeed's optimizer keeps some for every parameter, or none)."""

    hyper: dict[str, Any]
    scalars: dict[str, Any]
    parameters: list[Stage0Parameter]
    stepped: bool


def _moments(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0}


def stage0_groups(sd: dict[str, Any], group_shapes: list[dict[str, Shape]], module_sd: dict[str, torch.Tensor]
                  ) -> list[Stage0Group]:
    """DeepSpeed's stage-0 optimizer state ``sd`` seen per parameter, without copying a tensor: fp32, the torch
    optimizer's per-parameter state (the masters are the saved module's weights); bf16, its unfused wrapper's
    (per-parameter ``fp32_groups``) or fp16's fused wrapper's (``fp32_groups_flat`` with one flat state per
    group). ``group_shapes``: the live strategy's ``{name: shape}`` per group (DeepSpeed's stage-0 file names
    no parameter). The tensors may be left unread (meta: :class:`.tensor_file.TensorFile` reads their ranges)."""
    numels = [[int(torch.Size(s).numel()) for s in shapes.values()] for shapes in group_shapes]
    fused = "fp32_groups_flat" in sd
    base = sd["optimizer_state_dict"] if fused or "fp32_groups" in sd else sd
    if len(base["param_groups"]) != len(group_shapes):
        raise RuntimeError(f"this DeepSpeed stage-0 checkpoint has {len(base['param_groups'])} optimizer groups; "
                           f"the model here trains {len(group_shapes)}")
    out = []
    for gi, (group, shapes) in enumerate(zip(base["param_groups"], group_shapes)):
        names, hyper = list(shapes), {k: v for k, v in group.items() if k != "params"}
        if fused:
            master, state = sd["fp32_groups_flat"][gi], base["state"].get(group["params"][0], {})
            if master.numel() != sum(numels[gi]):
                raise RuntimeError(f"this DeepSpeed stage-0 checkpoint's group {gi} holds {master.numel()} elements; "
                                   f"the model here has {sum(numels[gi])}")
            offsets = [sum(numels[gi][:i]) for i in range(len(names))]
            parameters = [Stage0Parameter(n, numels[gi][i], master, _moments(state), offsets[i])
                          for i, n in enumerate(names)]
            out.append(Stage0Group(hyper, {k: v for k, v in state.items() if k not in _moments(state)}, parameters,
                                   bool(state)))
            continue
        ids = list(group["params"])
        if len(ids) != len(names):
            raise RuntimeError(f"this DeepSpeed stage-0 checkpoint has {len(ids)} parameters in optimizer group "
                               f"{gi}; the model here trains {len(names)}")
        masters = sd["fp32_groups"][gi] if "fp32_groups" in sd else [module_sd[n] for n in names]
        entries = [base["state"].get(pid, {}) for pid in ids]
        stepped = bool(entries) and all(entries)
        parameters = []
        for i, name in enumerate(names):
            if masters[i].numel() != numels[gi][i]:
                raise RuntimeError(f"this DeepSpeed stage-0 checkpoint's parameter {i} of group {gi} holds "
                                   f"{masters[i].numel()} elements; the model's {name} has {numels[gi][i]}")
            parameters.append(Stage0Parameter(name, numels[gi][i], masters[i], _moments(entries[i]) if stepped else {}))
        scalars = {k: v for k, v in entries[0].items() if k not in _moments(entries[0])} if stepped else {}
        out.append(Stage0Group(hyper, scalars, parameters, stepped))
    return out


def stage0_scale(sd: dict[str, Any]) -> dict[str, Any]:
    """A DeepSpeed stage-0 wrapper's loss scale as dsrun's scaler state (fp16; bf16's fixed 1 is ignored)."""
    if "cur_scale" not in sd:
        return {}
    keys = ("cur_scale", "cur_iter", "last_overflow_iter") if sd.get("dynamic_loss_scale") else ("cur_scale",)
    return {"loss_scaler": {k: sd[k] for k in keys if k in sd}, "dynamic_loss_scale": bool(sd["dynamic_loss_scale"])}


def _flat(tensors: list[torch.Tensor], offsets: list[int], numels: list[int]) -> torch.Tensor:
    """The parameters' elements put together in order, as one flat tensor."""
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.reshape(-1)[o:o + n] for t, o, n in zip(tensors, offsets, numels)])


def stage0_to_dsrun(sd: dict[str, Any], group_shapes: list[dict[str, Shape]], module_sd: dict[str, torch.Tensor]
                    ) -> dict[str, Any]:
    """DeepSpeed's stage-0 optimizer state as dsrun's stage-0 strategy state (:func:`stage0_groups` says where
    DeepSpeed keeps each parameter's elements); any other state is returned as it is."""
    if not is_deepspeed_stage0(sd):
        return sd
    masters, state, groups = [], {}, []
    for gi, group in enumerate(stage0_groups(sd, group_shapes, module_sd)):
        params = group.parameters
        offsets, numels = [p.offset for p in params], [p.numel for p in params]
        masters.append(_flat([p.master for p in params], offsets, numels).float())
        if group.stepped:
            state[gi] = {**group.scalars, **{k: _flat([p.moments[k] for p in params], offsets, numels)
                                            for k in params[0].moments}}
        groups.append({**group.hyper, "params": [gi]})
    return {"zero_stage": 0, "partition_count": 1, "base_optimizer_state": {"state": state, "param_groups": groups},
            "single_partition_of_fp32_groups": masters, "group_paddings": [0] * len(masters),
            "param_shapes": [list(shapes.values()) for shapes in group_shapes], **stage0_scale(sd)}
