"""Legacy and alias keys, rewritten to their current names before validation.

Each rewrite of a deprecated key emits a :class:`LegacyConfigWarning` (through :mod:`warnings` and the
``dsrun.config`` logger). Giving a deprecated key together with its replacement is an error, as in
DeepSpeed, because one of the two would be silently ignored.

| old | new |
|---|---|
| ``bfloat16`` | ``bf16`` |
| ``zero_optimization: true/false`` (+ top-level ``allgather_size``) | ``{"stage": 1/0, "allgather_bucket_size": ...}`` |
| ``fp32_allreduce: true`` (pre-2022 name) | ``communication_data_type: "fp32"`` |
| ``zero_optimization.cpu_offload: true`` | ``offload_optimizer: {"device": "cpu"}`` |
| ``zero_optimization.cpu_offload_param(s): true`` | ``offload_param: {"device": "cpu"}`` |
| ``zero_optimization.cpu_offload_use_pin_memory`` | dropped (no effect in DeepSpeed; use ``pin_memory``) |
| ``zero_optimization.stage3_gather_fp16_weights_on_model_save`` | ``stage3_gather_16bit_weights_on_model_save`` |
| ``aio.intra_op_parallelism``, ``seq_parallel_communication_data_type`` (DeepSpeed 0.19's names) | ``aio.thread_count``, ``seq_parallel_comm_data_type`` (silently) |
| ``elasticity.prefer_large_batch`` (documented spelling) | dropped: DeepSpeed reads only ``prefer_larger_batch`` (D9) |

DeepSpeed also accepts the stage-3 ZeRO keys without the ``stage3_`` prefix (its field names); those are
renamed silently, since they are not deprecated.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any

from dsrun.utils.errors import Problem, show

logger = logging.getLogger("dsrun.config")


class LegacyConfigWarning(UserWarning):
    """A deprecated DeepSpeed config key was rewritten to its current form."""


STAGE3_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "allgather_sequential": "stage3_allgather_sequential",
}


class _Migration:
    def __init__(self, prefix: str, quiet: bool = False):
        self.prefix, self.quiet = prefix, quiet
        self.problems: list[Problem] = []
        self.notes: list[str] = []

    def path(self, *parts: str) -> str:
        return ".".join(p for p in (self.prefix.rstrip("."), *parts) if p)

    def warn(self, path: str, text: str) -> None:
        message = f"{path}: {text}"
        self.notes.append(message)
        if self.quiet:
            return
        logger.warning("%s", message)
        warnings.warn(message, LegacyConfigWarning, stacklevel=4)

    def conflict(self, old_path: str, new_path: str) -> None:
        self.problems.append(Problem(
            old_path, f"deprecated key given together with its replacement {new_path!r}",
            f"remove {old_path.rsplit('.', 1)[-1]!r} and keep {new_path.rsplit('.', 1)[-1]!r}",
        ))

    def rename(self, section: dict[str, Any], old: str, new: str, parts: tuple[str, ...], deprecated: bool) -> None:
        if old not in section:
            return
        old_path, new_path = self.path(*parts, old), self.path(*parts, new)
        if new in section:
            self.conflict(old_path, new_path)
            del section[old]  # reported here; not again as an unknown key
            return
        section[new] = section.pop(old)
        if deprecated:
            self.warn(old_path, f"deprecated, renamed to {new!r}")
        else:
            logger.debug("%s: accepted as %s", old_path, new_path)


def _bool_flag(section: dict[str, Any], key: str, m: _Migration, parts: tuple[str, ...]) -> bool | None:
    value = section[key]
    if isinstance(value, bool):
        return value
    m.problems.append(Problem(m.path(*parts, key), f"got {show(value)}; allowed: true or false"))
    del section[key]  # reported here; not again as an unknown key
    return None


def _offload_flag(zero: dict[str, Any], old: str, new: str, m: _Migration) -> None:
    if old not in zero:
        return
    old_path, new_path = m.path("zero_optimization", old), m.path("zero_optimization", new)
    if new in zero:
        m.conflict(old_path, new_path)
        del zero[old]
        return
    value = _bool_flag(zero, old, m, ("zero_optimization",))
    if value is None:
        return
    del zero[old]
    if value:
        zero[new] = {"device": "cpu"}
        m.warn(old_path, f"deprecated, migrated to {new_path} = {{\"device\": \"cpu\"}}")
    else:
        m.warn(old_path, f"deprecated (false has no effect), use {new!r}; removed")


def migrate_legacy(data: dict[str, Any], prefix: str = "",
                   quiet: bool = False) -> tuple[dict[str, Any], list[Problem], list[str]]:
    """Rewrite legacy keys in a copy of ``data``; returns (new dict, problems, warning texts). ``quiet``: the
    warnings are only returned, not logged nor raised as :class:`LegacyConfigWarning` (a one-section read:
    the whole config's parse says them)."""
    m = _Migration(prefix, quiet)
    out = dict(data)
    m.rename(out, "bfloat16", "bf16", (), deprecated=True)
    # DeepSpeed 0.19's names for keys dsrun knows by their 0.14 names
    m.rename(out, "seq_parallel_communication_data_type", "seq_parallel_comm_data_type", (), deprecated=False)
    if isinstance(out.get("aio"), dict):
        out["aio"] = dict(out["aio"])
        m.rename(out["aio"], "intra_op_parallelism", "thread_count", ("aio",), deprecated=False)

    zero = out.get("zero_optimization")
    if isinstance(zero, bool):
        new_zero: dict[str, Any] = {"stage": 1 if zero else 0}
        if zero:
            new_zero["allgather_bucket_size"] = out.pop("allgather_size", 500_000_000)
        m.warn(m.path("zero_optimization"),
               f"the boolean form is deprecated, migrated to {{\"stage\": {new_zero['stage']}}}")
        out["zero_optimization"] = new_zero
    if "allgather_size" in out:
        out.pop("allgather_size")
        m.warn(m.path("allgather_size"), "legacy key, used only with the boolean zero_optimization form; ignored")

    if "fp32_allreduce" in out:
        value = _bool_flag(out, "fp32_allreduce", m, ())
        if value is not None:
            if value and "communication_data_type" in out:
                m.conflict(m.path("fp32_allreduce"), m.path("communication_data_type"))
                out.pop("fp32_allreduce")
            else:
                out.pop("fp32_allreduce")
                if value:
                    out["communication_data_type"] = "fp32"
                m.warn(m.path("fp32_allreduce"),
                       "deprecated, use communication_data_type" + (" (set to \"fp32\")" if value else "; removed"))

    zero = out.get("zero_optimization")
    if isinstance(zero, dict):
        zero = dict(zero)
        out["zero_optimization"] = zero
        _offload_flag(zero, "cpu_offload", "offload_optimizer", m)
        if "cpu_offload_param" in zero and "cpu_offload_params" in zero:
            m.conflict(m.path("zero_optimization", "cpu_offload_params"), m.path("zero_optimization", "cpu_offload_param"))
            del zero["cpu_offload_params"]
        _offload_flag(zero, "cpu_offload_param", "offload_param", m)
        _offload_flag(zero, "cpu_offload_params", "offload_param", m)
        if "cpu_offload_use_pin_memory" in zero:
            zero.pop("cpu_offload_use_pin_memory")
            m.warn(m.path("zero_optimization", "cpu_offload_use_pin_memory"),
                   "deprecated and ignored by DeepSpeed; set pin_memory in offload_param/offload_optimizer")
        m.rename(zero, "stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
                 ("zero_optimization",), deprecated=True)
        for old, new in STAGE3_ALIASES.items():
            m.rename(zero, old, new, ("zero_optimization",), deprecated=False)

    elastic = out.get("elasticity")
    if isinstance(elastic, dict) and "prefer_large_batch" in elastic:
        elastic = dict(elastic)
        out["elasticity"] = elastic
        elastic.pop("prefer_large_batch")
        m.warn(m.path("elasticity", "prefer_large_batch"),
               "documented spelling that DeepSpeed ignores; removed (DeepSpeed reads 'prefer_larger_batch')")
    return out, m.problems, m.notes
