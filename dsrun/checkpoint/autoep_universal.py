"""AutoEP's checkpoint records (``deepspeed.checkpoint.autoep_universal``): the folding record of a checkpoint
written by AutoEP folded over AutoTP.

A folded checkpoint records the rank layout it was written under under :data:`FOLDING_METADATA_KEY`
(``"folding"``): its tensor- and expert-parallel sizes and this rank's place in them, the expert tensor-parallel
size (always 1: experts are never cut by AutoTP), the ZeRO partition group a family of parameters is partitioned
over (``edp`` for routed experts, ``dense_dp`` for the rest) with this rank's place and the partition count, the
dispatch (``route_full_partition_dispatch``: every TP rank routes its whole batch, the experts' outputs are
gathered back over the TP group) and where shared experts live (``tp_sharded``). :func:`make_folding_metadata`
writes it; :func:`validate_folding_metadata` refuses to resume a checkpoint whose record differs from the
runtime's in any field the caller names (RuntimeError naming the field, the saved and the runtime value).
"""
from __future__ import annotations

from typing import Any, Mapping

from .constants import (FOLDING_DISPATCH_STRATEGY, FOLDING_EP_RANK, FOLDING_EP_SIZE, FOLDING_ETP_RANK,
                        FOLDING_ETP_SIZE, FOLDING_FAMILY, FOLDING_METADATA_KEY, FOLDING_METADATA_VERSION,
                        FOLDING_PARAM_FAMILIES, FOLDING_SHARED_EXPERT_PLACEMENT, FOLDING_TP_RANK, FOLDING_TP_SIZE,
                        FOLDING_ZERO_PARTITION_COUNT, FOLDING_ZERO_PARTITION_GROUP, FOLDING_ZERO_PARTITION_RANK)

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


def validate_folding_metadata(metadata: Any, *, tp_size: int, ep_size: int, etp_size: int = 1,
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
