"""``dsrun.zero.Init``: build a model with its parameters partitioned from the start.

Inside ``with dsrun.zero.Init():`` every ``torch.nn.Module`` partitions its parameters across the
data-parallel ranks as soon as its ``__init__`` returns: rank 0's freshly initialised values are broadcast,
each rank keeps its shard (:mod:`dsrun.zero.partition_params`) and the full tensors are freed. So a
model is never whole on any rank: at any moment a rank holds its shards of the modules built so far plus the
parameters of the one module being constructed (as in DeepSpeed).

A parent that re-initialises its children's weights after they were built (``GPT.reset_parameters``,
Hugging Face's ``_init_weights``) keeps working: inside the context, the ``torch.nn.init`` functions gather a
partitioned parameter, apply the init on rank 0, and re-partition the result. And with
``zero_optimization.override_module_apply`` (DeepSpeed's default, on) ``module.apply(fn)`` inside the context
gathers each module's own partitioned parameters around ``fn`` and re-partitions rank 0's result, so ``fn`` may
write ``param.data`` too (DeepSpeed's ``apply_with_gather``); with it off ``fn`` sees the partitioned
parameters (empty ``data``), as in DeepSpeed: what it writes through ``data`` is lost. Writing ``param.data``
outside ``apply`` is not intercepted; use :class:`~dsrun.zero.GatheredParameters` with ``modifier_rank=0``.

Tensors made inside the context by torch's constructors (``torch.zeros``, ``torch.arange``, ...) land on the
accelerator's device and, when the context has a dtype, floating ones are cast to it, as DeepSpeed's ``Init``
overrides them (``tensor_overrides``; :mod:`dsrun.zero.tensor_creation`).

This module is DeepSpeed's ``deepspeed.runtime.zero.partition_parameters`` (``dsrun/alias/paths.py``): it holds that
module's names (``Init``, ``GatheredParameters``, ``ZeroParamStatus``, ``zero_wrapper_for_fp_tensor_constructor``,
``_orig_torch_arange``, ``get_accelerator`` ...; the smaller ones, ``MultipleAllGatherHandles``, ``CUDAQuantizer``,
``get_allgather_dtype``, ``InsertPostInitMethodToModuleSubClasses`` ..., in :mod:`.partitioner_internals`), and
:class:`Init` looks the constructor wrapper up among its globals on entry, so a caller that replaces it here
(Hugging Face's ``prevent_arange_dtype_change``) is obeyed.

With ``memory_efficient_linear`` (the config's, default on) entering an :class:`Init`, or building one with
``module=``, routes ``F.linear`` through ZeRO-3's linear for the rest of the process, as DeepSpeed's does
(:mod:`dsrun.zero.linear`). Under a launcher that started several processes, an :class:`Init` whose group has
one rank (no ``data_parallel_group`` given) raises rather than leave every rank the whole model.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, Union

import torch

from dsrun import comm
from dsrun.accelerator import get_accelerator
from dsrun.comm.comm import ProcessGroup
from dsrun.ops.groupwise_quant import (QUANTIZED_ATTR, WEIGHT_QUANTIZATION_LAYERS, _quantize_param, float_weights,
                                       install_quantized_functionals)
from dsrun.zero import host_memory
from dsrun.zero.partition_params import ParamStatus as ZeroParamStatus
from dsrun.zero.partition_params import is_zero_param, partition_param
from dsrun.zero.partitioner_internals import (
    CUDAQuantizer, InsertPostInitMethodToModuleSubClasses, MultipleAllGatherHandles,
    _contradicting_single_rank_pg_error, get_allgather_dtype, partitioned_param_data_shape)
from dsrun.zero.linear import zero3_linear_wrap
from dsrun.zero.tensor_creation import (
    DEFAULT_TENSOR_OVERRIDES, DeepSpeedTensorOverride, _orig_torch_arange, _orig_torch_empty, _orig_torch_eye,
    _orig_torch_full, _orig_torch_ones, _orig_torch_randn, _orig_torch_tensor, _orig_torch_zeros,
    add_tensor_creation_wrappers, get_new_tensor_fn_for_dtype, remove_tensor_creation_wrappers,
    zero_wrapper_for_fp_tensor_constructor)
from dsrun.utils.errors import ConfigError, Problem

from .eager_fallback import CONTEXT_DEPTH_ATTR as DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR
from .eager_fallback import OWNER_ATTR as DS_Z3_EAGER_FALLBACK_OWNER_ATTR
from .gathered import GatheredParameters, keep_modified, register_external_parameter, unregister_external_parameter

if TYPE_CHECKING:
    from dsrun.config import DSConfig
    from dsrun.config.base import Section
    from dsrun.config.zero import AIOConfig, ZeroConfig

# the names of DeepSpeed's partition_parameters module that this module holds (see the module's docstring)
__all__ = ["CUDAQuantizer", "DEFAULT_TENSOR_OVERRIDES", "DS_Z3_EAGER_FALLBACK_OWNER_ATTR",
           "DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR", "DeepSpeedTensorOverride", "GatheredParameters", "Init",
           "InsertPostInitMethodToModuleSubClasses", "MiCS_Init", "MultipleAllGatherHandles", "ZeroParamStatus",
           "_contradicting_single_rank_pg_error", "_orig_torch_arange", "_orig_torch_empty", "_orig_torch_eye",
           "_orig_torch_full", "_orig_torch_ones", "_orig_torch_randn", "_orig_torch_tensor", "_orig_torch_zeros",
           "get_accelerator", "get_allgather_dtype", "get_new_tensor_fn_for_dtype", "is_zero_param",
           "partitioned_param_data_shape", "register_external_parameter", "unregister_external_parameter",
           "zero3_linear_wrap", "zero_wrapper_for_fp_tensor_constructor"]

# a DeepSpeed config: a dict, the path of a JSON/YAML file, or a typed config (``to_ds_dict``); None: no config
ConfigSource = Union[dict[str, Any], str, os.PathLike, "Section", None]


class DataParallelMpu(Protocol):
    """DeepSpeed's ``mpu`` as ``zero.Init`` uses it (Megatron's model-parallel unit)."""

    def get_data_parallel_group(self) -> ProcessGroup: ...

_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                   "sparse_")
_ACTIVE: list["Init"] = []  # the Init contexts entered, innermost last
_saved_init_functions: dict[str, Callable] = {}
_wrapped_classes: dict[type, Callable] = {}
_saved_init_subclass: list[Any] = []  # torch.nn.Module's own __init_subclass__, if it ever has one
_saved_apply: list[Callable] = []  # torch.nn.Module.apply while the outermost context overrides it
_RUNNING = "_ds_init_running"


_TRIM_AFTER_BYTES = 1 << 20


def _read_config(config_dict_or_path: ConfigSource | DSConfig) -> dict[str, Any] | DSConfig | None:
    """The config as given (a dict or a typed config; None: every default), or the file a path names, read."""
    from dsrun.config import typed_config

    if config_dict_or_path is None or isinstance(config_dict_or_path, dict) or typed_config(config_dict_or_path):
        return config_dict_or_path
    if hasattr(config_dict_or_path, "to_ds_dict"):
        return config_dict_or_path.to_ds_dict()
    path = Path(config_dict_or_path)
    if not path.is_file():
        raise ConfigError(Problem("zero.Init(config_dict_or_path=...)", f"{str(path)!r} is not a file",
                                  "pass a config dict or the path of a DeepSpeed JSON config"))
    from dsrun.config.sources import read_config_source

    return read_config_source(str(path)) if path.suffix != ".json" else json.loads(path.read_text())


def _zero_section(config: dict[str, Any] | DSConfig | None) -> ZeroConfig:
    """The typed ``zero_optimization`` section (the schema holds every default)."""
    from dsrun.config import ds_section

    return ds_section(config, "zero_optimization")


def _quantized_initialization(config: dict[str, Any] | DSConfig | None) -> dict[str, Any] | None:
    """``weight_quantization.quantized_initialization`` as the quantizer's dict, or None (unset or disabled)."""
    from dsrun.config import ds_section

    section = ds_section(config, "weight_quantization")
    if section is None or not section.enabled or section.quantized_initialization is None:
        return None
    return section.quantized_initialization.model_dump()


def _aio_section(config: dict[str, Any] | DSConfig | None) -> AIOConfig:
    from dsrun.config import ds_section

    return ds_section(config, "aio")


def _config_dtype(config: dict[str, Any] | DSConfig | None) -> torch.dtype | None:
    from dsrun.config import ds_section

    if ds_section(config, "fp16").enabled:
        return torch.float16
    if ds_section(config, "bf16").enabled:  # a raw dict's legacy "bfloat16" is migrated to bf16
        return torch.bfloat16
    return None


def _current() -> "Init | None":
    return _ACTIVE[-1] if _ACTIVE else None


def _wrap_module_init(cls: type) -> None:
    original = cls.__dict__.get("__init__")
    if original is None or getattr(original, "_ds_original", None) is not None:
        return

    @functools.wraps(original)
    def init(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        ctx = _current()
        if ctx is None or self.__dict__.get(_RUNNING):
            return original(self, *args, **kwargs)  # not under Init, or a super().__init__ inside one
        self.__dict__[_RUNNING] = True
        try:
            original(self, *args, **kwargs)
        finally:
            self.__dict__.pop(_RUNNING, None)
        ctx.partition_module(self)

    init._ds_original = original  # type: ignore[attr-defined]
    cls.__init__ = init
    _wrapped_classes[cls] = original


def _all_module_classes() -> list[type]:
    seen, stack = [], [torch.nn.Module]
    while stack:
        cls = stack.pop()
        seen.append(cls)
        stack.extend(c for c in cls.__subclasses__() if c not in seen)
    return seen


def _on_new_subclass(cls: type, **kwargs: object) -> None:  # __init_subclass__ keywords: ignored
    _wrap_module_init(cls)


def _zero_aware_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def init_fn(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if isinstance(tensor, torch.nn.Parameter) and is_zero_param(tensor):
            if getattr(tensor, DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR, 0):  # a user's block holds it gathered
                with float_weights([tensor]):  # a quantized weight takes the values, re-quantized
                    original(tensor, *args, **kwargs)
                keep_modified([tensor], 0)
                return tensor
            with GatheredParameters(tensor, modifier_rank=0), float_weights([tensor]):
                original(tensor, *args, **kwargs)
            return tensor
        return original(tensor, *args, **kwargs)
    return init_fn


def _gathering(fn: Callable[[torch.nn.Module], None]) -> Callable[[torch.nn.Module], None]:
    """``fn`` run on a module with its own partitioned parameters gathered; rank 0's values are then kept by
    every rank's shard (DeepSpeed's ``get_wrapped_fn_to_apply``: gather, call, broadcast, re-partition)."""
    if getattr(fn, "wrapped", False):  # DeepSpeed's mark: Module.apply recursing into the children
        return fn

    @functools.wraps(fn)
    def gathered_fn(module: torch.nn.Module) -> None:
        # a parameter a user's GatheredParameters block already holds stays that block's to release
        params = [p for p in module.parameters(recurse=False)
                  if is_zero_param(p) and not getattr(p, DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR, 0)]
        with GatheredParameters(params, modifier_rank=0), float_weights(params):  # quantized: re-quantized after
            fn(module)

    gathered_fn.wrapped = True  # type: ignore[attr-defined]
    return gathered_fn


def _apply_with_gather(original: Callable) -> Callable:
    @functools.wraps(original)
    def apply(self: torch.nn.Module, fn: Callable[[torch.nn.Module], None]) -> torch.nn.Module:
        return original(self, _gathering(fn))
    return apply


def _install(override_module_apply: bool) -> None:
    if override_module_apply:
        _saved_apply[:] = [torch.nn.Module.apply]
        torch.nn.Module.apply = _apply_with_gather(torch.nn.Module.apply)  # type: ignore[method-assign]
    for cls in _all_module_classes():
        if cls is not torch.nn.Module:
            _wrap_module_init(cls)
    _saved_init_subclass[:] = [torch.nn.Module.__dict__.get("__init_subclass__")]
    torch.nn.Module.__init_subclass__ = classmethod(_on_new_subclass)  # type: ignore[assignment]
    for name in _INIT_FUNCTIONS:
        original = getattr(torch.nn.init, name)
        _saved_init_functions[name] = original
        setattr(torch.nn.init, name, _zero_aware_init(original))


def _uninstall() -> None:
    if _saved_apply:
        torch.nn.Module.apply = _saved_apply.pop()  # type: ignore[method-assign]
    for cls, original in _wrapped_classes.items():
        cls.__init__ = original
    _wrapped_classes.clear()
    original = _saved_init_subclass[0] if _saved_init_subclass else None
    if original is None:
        del torch.nn.Module.__init_subclass__
    else:
        torch.nn.Module.__init_subclass__ = original
    _saved_init_subclass.clear()
    for name, original in _saved_init_functions.items():
        setattr(torch.nn.init, name, original)
    _saved_init_functions.clear()


class Init(InsertPostInitMethodToModuleSubClasses):
    """Partition parameters at construction: ``with dsrun.zero.Init(): model = MyModel()``.

    ``module``: partition an already built model now instead (no ``with`` needed). ``data_parallel_group``
    (or ``mpu.get_data_parallel_group()``): the ranks to partition over (default: all). ``remote_device``:
    where shards live: ``"cpu"`` (host memory), ``"nvme"`` (files under the config's
    ``zero_optimization.offload_param.nvme_path``, through the same swapper the engine then uses), or None
    (the config's ``offload_param.device`` if it sets one, else the accelerator's device; on a CPU machine
    that is the host). Parameters below ``stage3_param_persistence_threshold`` stay in memory, as the engine
    keeps them gathered anyway. ``pin_memory`` needs ``remote_device`` cpu or nvme (pinned I/O buffers).
    ``dtype``: convert floating parameters to this dtype
    (default: the config's fp16/bf16 precision if ``config_dict_or_path``/``config`` is given, else keep
    each parameter's dtype). ``tensor_overrides`` (DeepSpeed's, default both): with
    ``DeepSpeedTensorOverride.device`` tensors made inside the context without a device land on the accelerator's
    device, with ``.dtype`` floating ones are cast to ``dtype`` (when there is one). ``mem_efficient_linear``
    (overridden by the config's ``zero_optimization.memory_efficient_linear`` when a config is given): route
    ``F.linear`` through ZeRO-3's linear on entry (or at once with ``module``), for the rest of the process.
    ``enabled=False`` makes it a no-op. Initializes ``dsrun.comm`` if needed; with no group given, a one-rank
    world under a launcher that started several processes raises RuntimeError. ``override_module_apply`` (the
    config's ``zero_optimization.override_module_apply`` when a config is given, else this class attribute, as
    in DeepSpeed; default True): ``module.apply(fn)`` inside the outermost context gathers each module's
    parameters around ``fn`` (module docstring).
    Only meaningful with ZeRO stage 3: the engine takes the partitioned model as it is.
    """

    override_module_apply = True  # DeepSpeed's class attribute (its default)

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group: ProcessGroup = None,
                 remote_device: str | None = None, pin_memory: bool = False,
                 config_dict_or_path: ConfigSource = None, config: ConfigSource = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: DataParallelMpu | None = None,
                 tensor_overrides: tuple[DeepSpeedTensorOverride, ...] | list[DeepSpeedTensorOverride]
                 = DEFAULT_TENSOR_OVERRIDES, mem_efficient_linear: bool = True,
                 **_unused: object):  # DeepSpeed's other keywords, accepted and ignored
        self.enabled = enabled
        if not enabled:
            return
        self.tensor_overrides = tuple(tensor_overrides or ())
        if remote_device not in (None, "cpu", "none", "nvme"):
            raise ConfigError(Problem("zero.Init(remote_device=...)", f"got {remote_device!r}",
                                      "allowed: None, \"cpu\", \"nvme\""))
        cfg = _read_config(config_dict_or_path if config_dict_or_path is not None else config)
        zero_section = _zero_section(cfg)
        offload_section = zero_section.offload_param
        if remote_device is None and offload_section.device != "none":
            remote_device = offload_section.device  # DeepSpeed: default to the config's param offload device
        if pin_memory and remote_device not in ("cpu", "nvme"):
            raise ConfigError(Problem("zero.Init(pin_memory=...)",
                                      "pin_memory=True needs remote_device=\"cpu\" or \"nvme\"",
                                      "pass remote_device=\"cpu\" or drop pin_memory"))
        if remote_device == "nvme" and not offload_section.nvme_path:
            raise ConfigError(Problem("zero.Init(remote_device=\"nvme\")",
                                      "needs zero_optimization.offload_param.nvme_path in the config",
                                      "pass config_dict_or_path= a config whose offload_param sets device: nvme "
                                      "and nvme_path"))
        self.dtype = dtype or _config_dtype(cfg)
        self.mem_efficient_linear = zero_section.memory_efficient_linear if cfg is not None else mem_efficient_linear
        self.persistence_threshold = int(zero_section.stage3_param_persistence_threshold)
        self.quantized_initialization = _quantized_initialization(cfg)  # the rule dict, or None
        if cfg is not None:
            self.override_module_apply = zero_section.override_module_apply
        if not comm.is_initialized():
            comm.init_distributed(verbose=False)
        if data_parallel_group is None and mpu is not None:
            data_parallel_group = mpu.get_data_parallel_group()
        self.group = data_parallel_group
        contradiction = _contradicting_single_rank_pg_error(comm.get_world_size(self.group), self.group)
        if contradiction is not None:
            raise RuntimeError(contradiction)
        self.partition_group = self._partition_group(cfg)  # the data group, or MiCS's shard group
        self.device = torch.device("cpu") if remote_device in ("cpu", "nvme") else get_accelerator().device()
        if self.device.type == "cpu":
            host_memory.fix_mmap_threshold()  # each freed full tensor goes back to the OS at once
        self.pin_memory = pin_memory
        self.offload = None  # shards go to host memory or NVMe files as they are made
        if remote_device in ("cpu", "nvme"):
            from dsrun.offload.param_swapper import build_param_offload

            section = offload_section.model_copy(update={"device": remote_device, "pin_memory": pin_memory})
            self.offload = build_param_offload(section, get_accelerator().device(), aio_config=_aio_section(cfg),
                                               rank=comm.get_rank(), dtype=self.dtype)
        self.src = 0 if self.group is None else comm.get_global_rank(self.group, 0)
        if module is not None:
            if self.mem_efficient_linear:
                self._enable_mem_efficient_linear()
            if self.quantized_initialization:
                install_quantized_functionals()
            self.partition_module(module)

    def _partition_group(self, config: dict[str, Any] | DSConfig | None) -> ProcessGroup:
        return self.group

    def get_dp_process_group(self) -> ProcessGroup:
        return self.group

    def get_partition_rank(self) -> int:
        return comm.get_rank(self.partition_group)

    def partition_module(self, module: torch.nn.Module) -> None:
        """Partition every parameter of ``module`` not partitioned yet (rank 0's values win)."""
        seen: set[int] = set()
        freed = 0
        # weight_quantization.quantized_initialization: these layers' weights are stored quantized from now on
        quantize = {id(m.weight) for m in module.modules() if type(m) in WEIGHT_QUANTIZATION_LAYERS
                    } if self.quantized_initialization else set()
        with torch.no_grad():
            for p in module.parameters():
                if id(p) in seen or is_zero_param(p) or p.is_meta:
                    continue  # meta parameters hold no values (typically replaced, as a tied head is)
                seen.add(id(p))
                if self.dtype is not None and p.is_floating_point() and p.dtype != self.dtype:
                    p.data = p.data.to(self.dtype)
                if comm.get_world_size(self.group) > 1:
                    comm.broadcast(p.data, src=self.src, group=self.group)
                if id(p) in quantize and not getattr(p, QUANTIZED_ATTR, False):
                    _quantize_param(p, self.quantized_initialization)  # rank 0's values, before partitioning
                freed += p.numel() * p.element_size()
                partition_param(p, self.partition_group, device=self.device)
                if self.offload is not None and p.ds_numel >= self.persistence_threshold \
                        and p.ds_tensor.is_floating_point():
                    self.offload.adopt(p)  # pins (cpu) or writes the shard to its file and drops it (nvme)
        if freed >= _TRIM_AFTER_BYTES:
            # The full tensors just freed may sit in the middle of the heap, where glibc keeps them resident;
            # hand their pages back so the process really holds only its shards.
            host_memory.trim()

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        if not _ACTIVE:  # the outermost context's overrides hold for the whole build, as in DeepSpeed
            _install(self.override_module_apply)
            # the wrapper is this module's global as it is now, not as imported: a caller may have replaced it
            add_tensor_creation_wrappers(zero_wrapper_for_fp_tensor_constructor, self.dtype,
                                         get_accelerator().device(), self.tensor_overrides)
        _ACTIVE.append(self)
        if self.mem_efficient_linear:
            self._enable_mem_efficient_linear()
        if self.quantized_initialization:  # over ZeRO-3's linear, as DeepSpeed wraps it
            install_quantized_functionals()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        _ACTIVE.remove(self)
        if not _ACTIVE:
            remove_tensor_creation_wrappers()
            _uninstall()


class MiCS_Init(Init):  # noqa: N801 - DeepSpeed's name
    """:class:`Init` for MiCS: parameters are partitioned over shard groups of
    ``zero_optimization.mics_shard_size`` consecutive data-parallel ranks (from ``config_dict_or_path`` or
    ``config``, required) and replicated across them, as the engine then trains them. Rank 0's values are
    broadcast over the whole data-parallel group first, so every replica starts the same. The shard groups are
    the run's (:func:`dsrun.comm.groups.current_groups`, made so when there are none), which the engine then adopts.
    ``sequence_data_parallel_group`` is accepted for DeepSpeed's signature."""

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group: ProcessGroup = None,
                 sequence_data_parallel_group: ProcessGroup = None, mem_efficient_linear: bool = True,
                 remote_device: str | None = None, pin_memory: bool = False,
                 config_dict_or_path: ConfigSource = None, config: ConfigSource = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: DataParallelMpu | None = None):
        super().__init__(module=module, data_parallel_group=data_parallel_group, remote_device=remote_device,
                         pin_memory=pin_memory, config_dict_or_path=config_dict_or_path, config=config,
                         enabled=enabled, dtype=dtype, mpu=mpu, mem_efficient_linear=mem_efficient_linear)

    def _partition_group(self, config: dict[str, Any] | DSConfig | None) -> ProcessGroup:
        from dsrun.comm.groups import ProcessGroups, current_groups, from_data_group, set_current_groups

        shard = int(_zero_section(config).mics_shard_size)
        if shard < 1:
            raise ConfigError(Problem("zero.MiCS_Init(config_dict_or_path=...)",
                                      "needs zero_optimization.mics_shard_size >= 1 in the config",
                                      "pass the training config, with mics_shard_size set"))
        dp = comm.get_world_size(self.group)
        if dp % shard:
            raise ConfigError(Problem("zero_optimization.mics_shard_size",
                                      f"got {shard}; it must divide the data-parallel size {dp}",
                                      f"use a divisor of {dp}"))
        if shard == dp:
            return self.group
        # the run's groups when they share this data group (an engine's, or MoE's), else new ones made the run's:
        # the engine's groups adopt their shard groups (dsrun.comm.groups.set_current_groups), so it trains over
        # the very groups the parameters were partitioned over
        groups = current_groups()
        if groups is None or groups.data is not self.group:
            made = ProcessGroups() if self.group is None else from_data_group(self.group)
            if groups is None:
                set_current_groups(made)
            groups = made
        return groups.shard(shard)
