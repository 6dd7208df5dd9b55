"""AutoEP's checkpoint records and DeepSpeed's AutoEP universal conversion (``deepspeed.checkpoint.autoep_universal``).

**The folding record.**
A folded checkpoint records the rank layout it was written under under :data:`FOLDING_METADATA_KEY`
(``"folding"``): its tensor- and expert-parallel sizes and this rank's place in them, the expert tensor-parallel
size (always 1: experts are never cut by AutoTP), the ZeRO partition group a family of parameters is partitioned
over (``edp`` for routed experts, ``dense_dp`` for the rest) with this rank's place and the partition count, the
dispatch (``route_full_partition_dispatch``: every TP rank routes its whole batch, the experts' outputs are
gathered back over the TP group) and where shared experts live (``tp_sharded``). :func:`make_folding_metadata`
writes it; :func:`validate_folding_metadata` refuses to resume a checkpoint whose record differs from the
runtime's in any field the caller names (RuntimeError naming the field, the saved and the runtime value);
:func:`check_folding_record` is the engine's check at load (DeepSpeed's
``DeepSpeedEngine._validate_autoep_folding_checkpoint_metadata``): dsrun does not fold AutoEP over AutoTP, so a
folded checkpoint is refused when loaded.

**DeepSpeed's AutoEP checkpoints to the universal layout.** DeepSpeed's own AutoEP writes each expert to a file of
its own (``layer_{L}_expert_{e}_mp_rank_{m}_model_states.pt``, keys ``{prefix}.{w1|w2|w3}.{e}``) and its optimizer
states per expert-parallel rank (``expp_rank_{r}_mp_rank_{m}_optim_states.pt``); at ZeRO-1/2 the fp32 masters and
Adam moments are fragments per data-parallel rank. These readers put the experts of each layer back into one
``[num_experts, ...]`` tensor per weight in the universal layout (``zero/{prefix}.{w}/{fp32|exp_avg|exp_avg_sq}.pt``,
``param`` with ``cat_dim`` 0, ``is_expert_param``, ``ep_num_experts``), so a universal load can cut them again
for any ``autoep_size``: :func:`consolidate_autoep_expert_files` (the weights), :func:`consolidate_autoep_optimizer_states`
(the moments from the expert-parallel ranks' optimizer files), :func:`consolidate_autoep_zero12_expert_states` (the
ZeRO-1/2 fragments, gathered in the rank order of DeepSpeed's expert-data-parallel layout). Experts cut over
AutoTP lanes (a folded checkpoint) are refused: the folded runtime must load them. dsrun's own AutoEP checkpoints
are another layout (docs/moe.md), resumed at the same ``autoep_size``.
"""
from __future__ import annotations

import glob
import os
from typing import Any, Iterable, Mapping, Optional, Protocol

import torch

from .constants import (AUTOEP_EP_SIZE, AUTOEP_EXPERT_KEY_PREFIX, AUTOEP_NUM_EXPERTS, AUTOEP_NUM_LOCAL_EXPERTS,
                        AUTOEP_ZERO12_REQUIRED_FIELDS, CAT_DIM, EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS, PARAM,
                        FOLDING_DISPATCH_STRATEGY, FOLDING_EP_RANK, FOLDING_EP_SIZE, FOLDING_ETP_RANK,
                        FOLDING_ETP_SIZE, FOLDING_FAMILY, FOLDING_METADATA_KEY, FOLDING_METADATA_VERSION,
                        FOLDING_PARAM_FAMILIES, FOLDING_SHARED_EXPERT_PLACEMENT, FOLDING_TP_RANK, FOLDING_TP_SIZE,
                        FOLDING_ZERO_PARTITION_COUNT, FOLDING_ZERO_PARTITION_GROUP, FOLDING_ZERO_PARTITION_RANK)

LayersMetadata = Optional[list]  # a checkpoint's ds_autoep_layers: one dict per AutoEP layer (checked when read)


class FoldingSizes(Protocol):
    """What a folding check reads of the runtime's layout (:class:`dsrun.autoep.folding.ParallelFoldingSpec`)."""

    tp_size: int
    ep_size: int
    etp_size: int


FOLDED_DISPATCH_STRATEGY = "route_full_partition_dispatch"
FOLDED_SHARED_EXPERT_PLACEMENT = "tp_sharded"


def make_folding_metadata(*, tp_size: int, tp_rank: int, ep_size: int, ep_rank: int, zero_partition_group: str,
                          zero_partition_rank: int, zero_partition_count: int, family: str,
                          param_families: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The folding record of one checkpoint file (the value stored under ``"folding"``); ``param_families``: each
    parameter's own family record, when the file holds several families (a ZeRO optimizer's flat groups)."""
    metadata: dict[str, Any] = {
        "version": FOLDING_METADATA_VERSION, FOLDING_TP_SIZE: tp_size, FOLDING_TP_RANK: tp_rank,
        FOLDING_EP_SIZE: ep_size, FOLDING_EP_RANK: ep_rank, FOLDING_ETP_SIZE: 1, FOLDING_ETP_RANK: 0,
        FOLDING_ZERO_PARTITION_GROUP: zero_partition_group, FOLDING_ZERO_PARTITION_RANK: zero_partition_rank,
        FOLDING_ZERO_PARTITION_COUNT: zero_partition_count, FOLDING_DISPATCH_STRATEGY: FOLDED_DISPATCH_STRATEGY,
        FOLDING_SHARED_EXPERT_PLACEMENT: FOLDED_SHARED_EXPERT_PLACEMENT, FOLDING_FAMILY: family}
    if param_families is not None:
        metadata[FOLDING_PARAM_FAMILIES] = dict(param_families)
    return metadata


def validate_folding_metadata(metadata: object, *, tp_size: int, ep_size: int, etp_size: int = 1,
                              tp_rank: int | None = None, ep_rank: int | None = None, etp_rank: int | None = None,
                              zero_partition_group: str | None = None, zero_partition_rank: int | None = None,
                              zero_partition_count: int | None = None, family: str | None = None,
                              param_families: Mapping[str, Any] | None = None,
                              shared_expert_placement: str | None = None,
                              dispatch_strategy: str | None = None) -> dict[str, Any]:
    """The folding record of the checkpoint state ``metadata`` (a dict holding ``"folding"``), checked against the
    runtime: the sizes always, every other field the caller passes (not None). RuntimeError when the record is
    missing, of another version, or differs in a field."""
    if not isinstance(metadata, dict) or FOLDING_METADATA_KEY not in metadata:
        raise RuntimeError("Missing AutoEP+AutoTP folding metadata in folded checkpoint.")
    folding = metadata[FOLDING_METADATA_KEY]
    if folding.get("version") != FOLDING_METADATA_VERSION:
        raise RuntimeError(f"Unsupported folding metadata version: {folding.get('version')}")
    optional = {FOLDING_TP_RANK: tp_rank, FOLDING_EP_RANK: ep_rank, FOLDING_ETP_RANK: etp_rank,
                FOLDING_ZERO_PARTITION_GROUP: zero_partition_group, FOLDING_ZERO_PARTITION_RANK: zero_partition_rank,
                FOLDING_ZERO_PARTITION_COUNT: zero_partition_count, FOLDING_FAMILY: family,
                FOLDING_PARAM_FAMILIES: param_families, FOLDING_SHARED_EXPERT_PLACEMENT: shared_expert_placement,
                FOLDING_DISPATCH_STRATEGY: dispatch_strategy}
    expected = {FOLDING_TP_SIZE: tp_size, FOLDING_EP_SIZE: ep_size, FOLDING_ETP_SIZE: etp_size,
                **{key: value for key, value in optional.items() if value is not None}}
    for key, value in expected.items():
        if folding.get(key) != value:
            raise RuntimeError(f"Folding metadata mismatch for {key}: saved={folding.get(key)} runtime={value}")
    return folding


def check_folding_record(state: object, *, folding_spec: FoldingSizes | None, family: str | None = None,
                         zero_partition_group: str | None = None, zero_partition_count: int | None = None,
                         tp_rank: int | None = None, ep_rank: int | None = None,
                         zero_partition_rank: int | None = None, param_families: Mapping[str, Any] | None = None,
                         require_when_folded: bool = True) -> None:
    """A loaded checkpoint state's folding record against the runtime's layout (``folding_spec``: its
    :class:`~dsrun.autoep.folding.ParallelFoldingSpec`, None when AutoEP is not folded over AutoTP): a folded
    checkpoint needs a folded runtime, a folded runtime a folded checkpoint (unless ``require_when_folded`` is
    off), and the record must match the layout field by field (:func:`validate_folding_metadata`)."""
    recorded = isinstance(state, dict) and FOLDING_METADATA_KEY in state
    folded = folding_spec is not None and folding_spec.tp_size > 1
    if recorded and not folded:
        raise RuntimeError("Folded AutoEP+AutoTP checkpoint requires a folded runtime with matching "
                           "tensor_parallel.autotp_size and expert_parallel.autoep_size (dsrun does not fold AutoEP "
                           "over AutoTP: load it with DeepSpeed, or convert it with DeepSpeed's folded runtime).")
    if not folded:
        return
    if not recorded:
        if require_when_folded:
            raise RuntimeError("Missing AutoEP+AutoTP folding metadata in folded checkpoint.")
        return
    validate_folding_metadata(state, tp_size=folding_spec.tp_size, ep_size=folding_spec.ep_size,
                              etp_size=folding_spec.etp_size, etp_rank=0, tp_rank=tp_rank, ep_rank=ep_rank,
                              zero_partition_group=zero_partition_group, zero_partition_rank=zero_partition_rank,
                              zero_partition_count=zero_partition_count, param_families=param_families,
                              family=family, shared_expert_placement=FOLDED_SHARED_EXPERT_PLACEMENT,
                              dispatch_strategy=FOLDED_DISPATCH_STRATEGY)


# --- DeepSpeed's AutoEP checkpoints to the universal layout ------------------------------------------------------

_EXPERT_WEIGHTS = ("w1", "w2", "w3")
_MOMENTS = ("exp_avg", "exp_avg_sq")


def _universal_expert_state(tensor: torch.Tensor, num_experts: int, **extra: object) -> dict[str, Any]:
    return {PARAM: tensor, CAT_DIM: 0, EP_IS_EXPERT_PARAM: True, EP_NUM_EXPERTS: num_experts, **extra}


def _load(path: str) -> Any:
    return torch.load(path, map_location="cpu", weights_only=False)


def resolve_expert_ckpt_path(checkpoint_dir: str, moe_layer_id: int, global_expert_id: int) -> str:
    """The one file holding expert ``global_expert_id`` of MoE layer ``moe_layer_id``, whatever its model-parallel
    rank. FileNotFoundError when there is none; NotImplementedError when several hold it (AutoTP-cut experts:
    a folded checkpoint, or several model-parallel ranks)."""
    matches = sorted(glob.glob(os.path.join(
        checkpoint_dir, f"layer_{moe_layer_id}_expert_{global_expert_id}_mp_rank_*_model_states.pt")))
    if not matches:
        raise FileNotFoundError(f"Expert checkpoint file not found: layer_{moe_layer_id} expert_{global_expert_id} "
                                f"in {checkpoint_dir}")
    if len(matches) > 1:
        if any(FOLDING_METADATA_KEY in _load(path) for path in matches):
            raise NotImplementedError("Universal checkpoint conversion for folded AutoEP+AutoTP expert shards is not "
                                      "supported: load this checkpoint with the same folded layout, or merge the "
                                      "tensor-parallel expert shards before ds_to_universal.")
        raise NotImplementedError(f"Multiple expert checkpoint files found for layer_{moe_layer_id} "
                                  f"expert_{global_expert_id}: {matches}; experts over several model-parallel ranks "
                                  "are not supported.")
    return matches[0]


def _layers(autoep_layers_metadata: LayersMetadata, what: str) -> list[dict[str, Any]]:
    if autoep_layers_metadata is None:
        raise RuntimeError(f"AutoEP metadata is missing from checkpoint (ds_autoep_layers): cannot consolidate {what}.")
    if not isinstance(autoep_layers_metadata, list):
        raise RuntimeError(f"AutoEP metadata is malformed: expected list, got {type(autoep_layers_metadata).__name__}")
    return autoep_layers_metadata


def consolidate_autoep_expert_files(checkpoint_dir: str, output_dir: str, autoep_layers_metadata: LayersMetadata) -> None:
    """Each AutoEP layer's expert weights (one file per expert) stacked into ``[num_experts, ...]`` and written to
    ``output_dir/zero/{prefix}.{w}/fp32.pt`` (a checkpoint's folding record kept with it)."""
    for layer in _layers(autoep_layers_metadata, "expert files"):
        layer_id, num_experts, prefix = layer["moe_layer_id"], layer[AUTOEP_NUM_EXPERTS], layer[AUTOEP_EXPERT_KEY_PREFIX]
        states = []
        for expert in range(num_experts):
            path = resolve_expert_ckpt_path(checkpoint_dir, layer_id, expert)
            states.append((path, _load(path)))
        folding = next((state[FOLDING_METADATA_KEY] for _, state in states if FOLDING_METADATA_KEY in state), None)
        for weight in _EXPERT_WEIGHTS:
            tensors = []
            for expert, (path, state) in enumerate(states):
                key = f"{prefix}.{weight}.{expert}"
                if key not in state:
                    raise RuntimeError(f"Expected key '{key}' not found in {path}")
                tensors.append(state[key])
            out = os.path.join(output_dir, "zero", f"{prefix}.{weight}")
            os.makedirs(out, exist_ok=True)
            extra = {} if folding is None else {FOLDING_METADATA_KEY: folding}
            torch.save(_universal_expert_state(torch.stack(tensors), num_experts, **extra), os.path.join(out, "fp32.pt"))


def _state_of(states: Mapping[object, object], param_id: object) -> object:
    """An optimizer state entry by parameter id, the id as an int or a string."""
    for key in (param_id, str(param_id)):
        if key in states:
            return states[key]
    try:
        return states.get(int(param_id))
    except (TypeError, ValueError):
        return None


def _expert_param_ids(optim: Mapping[str, Any], layers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each layer's optimizer parameter id per expert weight: by the groups' ``param_names`` where recorded, else the
    next parameters (in param-group order) whose moments hold the layer's local experts as their first dimension."""
    named: dict[str, Any] = {}
    ordered: dict[str, Any] = {}  # by str(id), in param-group order
    for group in optim.get("param_groups", []):
        params, names = group.get("params", []), group.get("param_names")
        if isinstance(names, list) and len(names) == len(params):
            named.update(zip(names, params))
        for param_id in params:
            ordered.setdefault(str(param_id), param_id)
    states = optim.get("state", {})
    order = list(ordered.values()) or list(states)
    used: set[str] = set()
    out = []
    for layer in layers:
        ids = {w: named[f"{layer[AUTOEP_EXPERT_KEY_PREFIX]}.{w}"] for w in _EXPERT_WEIGHTS
               if f"{layer[AUTOEP_EXPERT_KEY_PREFIX]}.{w}" in named}
        used |= {str(i) for i in ids.values()}
        local = layer[AUTOEP_NUM_LOCAL_EXPERTS]
        candidates = (p for p in order if str(p) not in used and _holds_experts(_state_of(states, p), local))
        for weight, param_id in zip([w for w in _EXPERT_WEIGHTS if w not in ids], candidates):
            ids[weight] = param_id
            used.add(str(param_id))
        out.append(ids)
    return out


def _holds_experts(state: object, local: int) -> bool:
    return isinstance(state, Mapping) and any(
        torch.is_tensor(t := state.get(k)) and t.dim() == 3 and t.shape[0] == local for k in _MOMENTS)


def consolidate_autoep_optimizer_states(checkpoint_dir: str, output_dir: str, autoep_layers_metadata: LayersMetadata,
                                        ep_size: int) -> None:
    """Each expert weight's Adam moments from the ``ep_size`` expert-parallel ranks' optimizer files, concatenated
    along the expert dimension into ``output_dir/zero/{prefix}.{w}/{exp_avg,exp_avg_sq}.pt``. Nothing is written
    when the files or their optimizer payload are absent (a ZeRO-1/2 checkpoint keeps its moments in the ZeRO
    shards: :func:`consolidate_autoep_zero12_expert_states`)."""
    layers = _layers(autoep_layers_metadata, "optimizer states")
    ranks = []
    for rank in range(ep_size):
        matches = sorted(glob.glob(os.path.join(checkpoint_dir, f"expp_rank_{rank}_mp_rank_*_optim_states.pt")))
        if not matches:
            return
        ranks.append(_load(matches[0]).get("optimizer") or {})
    if not ranks or not ranks[0].get("state"):
        return
    for layer, ids in zip(layers, _expert_param_ids(ranks[0], layers)):
        local = layer[AUTOEP_NUM_LOCAL_EXPERTS]
        for weight in _EXPERT_WEIGHTS:
            out = os.path.join(output_dir, "zero", f"{layer[AUTOEP_EXPERT_KEY_PREFIX]}.{weight}")
            os.makedirs(out, exist_ok=True)
            if weight not in ids:
                continue
            for moment in _MOMENTS:
                pieces = [(_state_of(rank.get("state", {}), ids[weight]) or {}).get(moment) for rank in ranks]
                if all(torch.is_tensor(t) and t.dim() == 3 and t.shape[0] == local for t in pieces):
                    torch.save(_universal_expert_state(torch.cat(pieces), layer[AUTOEP_NUM_EXPERTS]),
                               os.path.join(out, f"{moment}.pt"))


def get_autoep_zero12_expert_param_info(autoep_layers_metadata: LayersMetadata) -> dict[str, dict[str, int]]:
    """``{prefix}.{w}`` -> its layer's ``num_experts``, ``num_local_experts`` and ``ep_size``, each layer's
    record checked (RuntimeError naming what is wrong)."""
    if not isinstance(autoep_layers_metadata, list) or not autoep_layers_metadata:
        raise RuntimeError("AutoEP metadata must be a non-empty list for ZeRO-1/2 universal conversion.")
    info: dict[str, dict[str, int]] = {}
    for layer in autoep_layers_metadata:
        if not isinstance(layer, dict):
            raise RuntimeError("AutoEP layer metadata must contain dictionaries.")
        missing = [field for field in AUTOEP_ZERO12_REQUIRED_FIELDS if field not in layer]
        if missing:
            raise RuntimeError(f"AutoEP layer metadata is missing fields: {missing}")
        prefix = layer[AUTOEP_EXPERT_KEY_PREFIX]
        if not isinstance(prefix, str) or not prefix:
            raise RuntimeError("AutoEP expert_key_prefix must be a non-empty string.")
        sizes = {}
        for field in (AUTOEP_NUM_EXPERTS, AUTOEP_NUM_LOCAL_EXPERTS, AUTOEP_EP_SIZE):
            value = layer[field]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RuntimeError(f"AutoEP {field} must be a positive integer, got {value!r}.")
            sizes[field] = value
        if sizes[AUTOEP_NUM_EXPERTS] != sizes[AUTOEP_NUM_LOCAL_EXPERTS] * sizes[AUTOEP_EP_SIZE]:
            raise RuntimeError(f"AutoEP expert count mismatch for {prefix}: num_experts={sizes[AUTOEP_NUM_EXPERTS]}, "
                               f"num_local_experts={sizes[AUTOEP_NUM_LOCAL_EXPERTS]}, ep_size={sizes[AUTOEP_EP_SIZE]}.")
        for weight in _EXPERT_WEIGHTS:
            if f"{prefix}.{weight}" in info:
                raise RuntimeError(f"Duplicate AutoEP expert parameter metadata for {prefix}.{weight}.")
            info[f"{prefix}.{weight}"] = dict(sizes)
    return info


def _zero12_fragment_path(temp_dir: str, param_name: str, state_name: str, dp_rank: int) -> str:
    """Where DeepSpeed's ZeRO-1/2 extraction leaves data-parallel rank ``dp_rank``'s fragment of one state of one
    parameter (``{temp}/{param}/0/{state}.{rank:02d}``)."""
    return os.path.join(temp_dir, param_name, "0", f"{state_name}.{dp_rank:02d}")


def _autoep_zero12_dp_ranks(ep_rank: int, dp_degree: int, ep_size: int,
                            use_data_before_expert_parallel: bool) -> Iterable[int]:
    """The data-parallel ranks holding expert-parallel rank ``ep_rank``'s experts, in their partition order:
    ``ep_size`` consecutive ranks form an expert-parallel group (every ``ep_size``-th rank holds the same experts),
    or with data before expert parallelism ``dp/ep`` consecutive ranks hold the same experts."""
    if dp_degree % ep_size:
        raise RuntimeError(f"ZeRO DP degree {dp_degree} is not divisible by AutoEP size {ep_size}.")
    if use_data_before_expert_parallel:
        replicas = dp_degree // ep_size
        return range(ep_rank * replicas, (ep_rank + 1) * replicas)
    return range(ep_rank, dp_degree, ep_size)


def _same(left: object, right: object) -> bool:
    return torch.equal(left, right) if torch.is_tensor(left) and torch.is_tensor(right) else left == right


def consolidate_autoep_zero12_expert_states(temp_dir: str, output_dir: str, expert_param_info: Mapping[str, Any],
                                            slice_shapes: Mapping[str, Any], dp_degree: int, tp_degree: int,
                                            use_data_before_expert_parallel: bool) -> None:
    """Each expert parameter's fp32 master and Adam moments from DeepSpeed's ZeRO-1/2 fragments (``temp_dir``, as
    :func:`_zero12_fragment_path` places them): for each expert-parallel rank, the fragments of the data-parallel
    ranks holding its experts concatenated into its local ``[num_local_experts, ...]`` slice, the ranks' slices
    stacked into ``[num_experts, ...]``; the optimizer step, which every rank must agree on. Written to
    ``output_dir/zero/{param}/``. RuntimeError naming the parameter when a fragment is missing, not fp32, or does
    not fill the slice; NotImplementedError with AutoTP (``tp_degree`` > 1)."""
    if tp_degree != 1:
        raise NotImplementedError("ZeRO-1/2 universal conversion of AutoEP experts with tensor parallelism "
                                  f"(tp_degree {tp_degree}) is not supported.")
    for name, sizes in expert_param_info.items():
        if name not in slice_shapes:
            raise RuntimeError(f"AutoEP expert parameter {name} is missing from checkpoint parameter shapes.")
        ep_size, num_experts, local = sizes["ep_size"], sizes["num_experts"], sizes["num_local_experts"]
        shape = tuple(slice_shapes[name])
        if not shape or shape[0] != local:
            raise RuntimeError(f"AutoEP local shape mismatch for {name}: shape={shape}, num_local_experts={local}.")
        out = os.path.join(output_dir, "zero", name)
        os.makedirs(out, exist_ok=True)
        for state in ("fp32",) + _MOMENTS:
            slices = []
            for ep_rank in range(ep_size):
                pieces = []
                for dp_rank in _autoep_zero12_dp_ranks(ep_rank, dp_degree, ep_size, use_data_before_expert_parallel):
                    path = _zero12_fragment_path(temp_dir, name, state, dp_rank)
                    if not os.path.isfile(path):
                        continue  # this rank's partition held none of the parameter
                    piece = _load(path)
                    if not torch.is_tensor(piece) or piece.dtype != torch.float32:
                        raise RuntimeError(f"AutoEP {state} fragment must be an fp32 tensor: {path}")
                    pieces.append(piece.flatten())
                if not pieces:
                    raise RuntimeError(f"Missing AutoEP {state} fragments for {name}, EP rank {ep_rank}.")
                flat = torch.cat(pieces)
                if flat.numel() != torch.Size(shape).numel():
                    raise RuntimeError(f"AutoEP {state} fragment size mismatch for {name}, EP rank {ep_rank}: got "
                                       f"{flat.numel()}, expected {torch.Size(shape).numel()}.")
                slices.append(flat.reshape(shape))
            whole = torch.cat(slices)
            if whole.shape[0] != num_experts:
                raise RuntimeError(f"AutoEP consolidated expert count mismatch for {name}: got {whole.shape[0]}, "
                                   f"expected {num_experts}.")
            torch.save(_universal_expert_state(whole, num_experts), os.path.join(out, f"{state}.pt"))
        steps = [_load(path) for rank in range(dp_degree)
                 if os.path.isfile(path := _zero12_fragment_path(temp_dir, name, "step", rank))]
        if not steps:
            raise RuntimeError(f"Missing AutoEP optimizer step for {name}.")
        if not all(_same(steps[0], step) for step in steps[1:]):
            raise RuntimeError(f"Inconsistent AutoEP optimizer steps for {name}.")
        torch.save(steps[0], os.path.join(out, "step.pt"))
