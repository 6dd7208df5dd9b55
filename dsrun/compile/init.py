"""Turning DeepCompile on for an engine (DeepSpeed's ``init_z3``/``init_z1_and_2`` and the engine's
``get_deepcompile_backend``): ``compile: {deepcompile: true}`` and ``engine.compile()``.

At ZeRO-3 over more than one rank the stage-3 strategy hands its gathers and its gradient intake to the graph
(:meth:`dsrun.zero.stage3.Stage3Strategy.hand_over_to_compiler`), every parameter is registered with the handle,
and the module's forward is compiled through :class:`.backend.DeepCompileBackend` on the schedule (DeepSpeed's
default unless given: ``zero3_compile`` from step 0; from step 5 also ``prefetch`` and ``selective_gather``).
Where DeepSpeed falls back to the torch compiler, dsrun does too, saying why: stage 0, stages 1-2 (the
stage's gradient hooks reduce what the compiled backward returns: :mod:`.passes.zero_1_and_2_compile`) and a
ZeRO-3 whose parameters are kept whole (a partition group of one: nothing to gather).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Protocol, Sequence

import torch

from dsrun.compile.backend import (DeepCompileBackend, cleanup_compiled_backward_state, gathered_forward, init_schedule,
                                   launch_compile_passes, log_rank0)
from dsrun.compile.handle import get_deepcompile_handle
from dsrun.compile.passes import (offload_activation, offload_adam_states, offload_parameters, prefetch,
                                  selective_gather, zero_1_and_2_compile, zero3_compile)
from dsrun.compile.passes.contract import PassContract, register_pass_contract, validate_schedule
from dsrun.compile.shard_moves import ShardMoves
from dsrun.config.misc import CompileConfig
from dsrun.utils.errors import ConfigError, Problem



class CompilingEngine(Protocol):
    """What DeepCompile reads of the engine."""

    module: torch.nn.Module
    strategy: Any
    global_steps: int
    _config: Any


WARMUP = 5  # DeepSpeed's: steps before the profile-driven passes join

opt_passes: dict[str, Callable] = {}  # name -> pass (DeepSpeed's ``backend.opt_passes``)


def register_compile_pass(name: str, pass_fn: Callable, contract: PassContract | None = None) -> None:
    """Make ``pass_fn`` schedulable by ``name``, with its contract (None: unconstrained)."""
    opt_passes[name] = pass_fn
    register_pass_contract(name, contract)


register_compile_pass(zero3_compile.NAME, zero3_compile.add_z3_gather_release, zero3_compile.CONTRACT)
register_compile_pass(prefetch.NAME, prefetch.schedule_prefetch, prefetch.CONTRACT)
register_compile_pass(selective_gather.NAME, selective_gather.selective_gather, selective_gather.CONTRACT)
register_compile_pass(offload_parameters.NAME, offload_parameters.offload_parameter_fwd, offload_parameters.CONTRACT)
register_compile_pass(zero_1_and_2_compile.NAME_Z1, zero_1_and_2_compile.add_z1_reduce, zero_1_and_2_compile.CONTRACT_Z1)
register_compile_pass(zero_1_and_2_compile.NAME_Z2, zero_1_and_2_compile.add_z2_reduce, zero_1_and_2_compile.CONTRACT_Z2)
register_compile_pass(offload_adam_states.NAME, offload_adam_states.move_opt_states, offload_adam_states.CONTRACT)
register_compile_pass(offload_adam_states.NAME_SYNC, offload_adam_states.move_opt_states_sync,
                      offload_adam_states.CONTRACT_SYNC)
register_compile_pass(offload_adam_states.NAME_FOR_INIT, offload_adam_states.offload_adam_states_for_init,
                      offload_adam_states.CONTRACT_FOR_INIT)
register_compile_pass(offload_activation.NAME, offload_activation.offload_activation, offload_activation.CONTRACT)
register_compile_pass(offload_activation.FLOOR_NAME, offload_activation.offload_activation_floor,
                      offload_activation.CONTRACT)


def default_schedule() -> list[tuple[int, list[Callable]]]:
    return [(0, [zero3_compile.add_z3_gather_release]),
            (WARMUP, [zero3_compile.add_z3_gather_release, prefetch.schedule_prefetch,
                      selective_gather.selective_gather])]


def resolve_schedule(schedule: Sequence[tuple[int, list]] | None) -> list[tuple[int, list[Callable]]]:
    """A user's schedule validated against the contracts, names turned into the passes."""
    if schedule is None:
        return default_schedule()
    validate_schedule(schedule, opt_passes)
    resolved = []
    for step, passes in schedule:
        for p in passes:
            if not callable(p) and p not in opt_passes:
                raise ConfigError(Problem("compile schedule", f"unknown pass {p!r}", f"one of {sorted(opt_passes)}"))
        resolved.append((step, [p if callable(p) else opt_passes[p] for p in passes]))
    return resolved


def compiles_in_graph(strategy: object) -> str | None:
    """None when DeepCompile's ZeRO-3 graph path applies to ``strategy``; else why the torch compiler is used."""
    stage = getattr(strategy, "stage", 0)
    if strategy is None or stage == 0:
        return "DeepCompile needs ZeRO stage 1, 2 or 3"
    if stage in (1, 2):
        return f"at ZeRO stage {stage} the stage's gradient hooks reduce what the compiled backward returns"
    if getattr(strategy, "keeps_whole", False):
        return "every parameter is kept whole (a partition group of one): nothing to gather"
    return None


def refusal(strategy: object) -> Problem | None:
    """What DeepCompile at ZeRO-3 does not combine with in dsrun."""
    if getattr(strategy, "param_offload", None) is not None:
        return Problem("zero_optimization.offload_param", "cannot be combined with compile.deepcompile in dsrun",
                       "drop offload_param: compile.offload_parameters moves the shards to the host between their "
                       "uses in the graphs (or drop compile.deepcompile: eager ZeRO-3 offloads parameters)")
    if type(strategy.sharding).__name__ != "ShardingPolicy" or any(
            getattr(p, "ds_quantized_gather", None) for p in strategy.params):
        return Problem("zero_optimization", "ZeRO++/MiCS/hpZ cannot be combined with compile.deepcompile in dsrun",
                       "drop the ZeRO++ keys or compile.deepcompile")
    return None


def _reducer(queue: Callable, launch_pending: Callable, flush_numel: int) -> tuple[Callable, Callable]:
    """Gradients into the strategy's buckets, and what launches the pending ones (the backward's
    ``end_backward``). On the CPU (``flush_numel``: the largest module's elements) the pending buckets also go out
    each time that much arrived, as eager ZeRO-3 reduces module by module, so the reduce-scatters overlap the rest
    of the backward instead of all waiting for its end."""
    pending = [0]

    def release() -> None:
        pending[0] = 0
        launch_pending()

    def reduce(param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        queue(param, grad)
        pending[0] += param.ds_numel
        if flush_numel and pending[0] >= flush_numel:
            release()

    return reduce, release


_MISSING = object()
_DYNAMO_CONFIG_NAMES = ("force_parameter_static_shapes", "force_nn_module_property_static_shapes")
_dynamo_config_owners: dict[int, dict[str, Any]] = {}  # id(dynamo config) -> its saved values and owners
_dynamo_config_lock = threading.Lock()


def _allow_dynamo_dynamic_parameter_shapes_for_z3(compile_kwargs: dict[str, Any]) -> Callable[[], None] | None:
    """Dynamo's static-shape forcing for parameters and module properties off while a ZeRO-3 DeepCompile engine
    lives (DeepSpeed's: its parameters are placeholders whose shape is not the traced one); returns the release
    (None where dynamo has neither setting). The settings are process-wide: the first owner saves them, every
    owner turns them off, and they come back only when the last owner releases; a release counts once."""
    dynamo = getattr(torch, "_dynamo", None)
    if dynamo is None:
        import torch._dynamo as dynamo
    config = getattr(dynamo, "config", None)
    if config is None:
        return None
    token = object()
    with _dynamo_config_lock:
        state = _dynamo_config_owners.get(id(config))
        if state is None or state["config"] is not config:
            saved = {name: getattr(config, name) for name in _DYNAMO_CONFIG_NAMES if hasattr(config, name)}
            if not saved:
                return None
            state = {"config": config, "saved": saved, "owners": set()}
            _dynamo_config_owners[id(config)] = state
        state["owners"].add(token)
        for name in state["saved"]:
            setattr(config, name, False)

    def restore() -> None:
        with _dynamo_config_lock:
            if state is not _dynamo_config_owners.get(id(config)) or token not in state["owners"]:
                return
            state["owners"].discard(token)
            if state["owners"]:
                return
            for name, value in state["saved"].items():
                setattr(config, name, value)
            del _dynamo_config_owners[id(config)]

    return restore


def _resolve_expected_grad_dtype(param: torch.Tensor) -> torch.dtype | None:
    """The dtype a parameter's gradient is reduced in, by torch's leaf contract: its ``grad_dtype`` where set
    (None: whatever dtype the gradient has), else its own dtype."""
    grad_dtype = getattr(param, "grad_dtype", _MISSING)
    return param.dtype if grad_dtype is _MISSING else grad_dtype


def release_engine_state(engine: object) -> None:
    """What an engine holds of DeepCompile's process-wide state, given back (its ``destroy()``, or DeepCompile
    switched off): the frames whose backward it awaits (and their captured inputs) and its share of dynamo's
    settings. Safe on an engine that never compiled, and twice."""
    owned = getattr(engine, "_deepcompile_owned_frames", None)
    if owned:
        cleanup_compiled_backward_state(owned_frames=owned)
    restore = getattr(engine, "_deepcompile_dynamo_config_restore", None)
    if restore is not None:
        restore()
        del engine._deepcompile_dynamo_config_restore


def _check_offload_targets(engine: CompilingEngine, compile_config: CompileConfig,
                           schedule: Sequence[tuple[int, list]] | None) -> None:
    """DeepSpeed's refusals, before anything of the engine changes: ``offload_opt_states`` beside ZeRO's own
    optimizer offload (both would own the same states), and more than one offload target; and dsrun's:
    ``offload_parameters`` with a schedule that leaves its pass out (DeepSpeed then ignores the key)."""
    # DeepSpeed's first check comes first: its tests call init_z3 with a config that has only the keys it reads
    if compile_config.offload_opt_states and engine.zero_use_cpu_optimizer():
        raise ConfigError(Problem("compile.offload_opt_states", "cannot be combined with "
                                  "zero_optimization.offload_optimizer on cpu or nvme: both manage the optimizer's "
                                  "states (ZeRO keeps them on the host for the whole step, the pass moves them around "
                                  "the graph)", "enable one of them"))
    named = {getattr(p, "__name__", p) for _, passes in (schedule or []) for p in passes}
    if compile_config.offload_parameters and schedule is not None and not named & {
            offload_parameters.NAME, offload_parameters.offload_parameter_fwd.__name__}:
        raise ConfigError(Problem("compile.offload_parameters", "the schedule given to engine.compile() has no "
                                  "'offload_parameters' pass, so the key would do nothing",
                                  "add 'offload_parameters' after 'zero3_compile', or leave the schedule out"))
    if compile_config.offload_parameters and compile_config.offload_opt_states:
        raise ConfigError(Problem("compile.offload_parameters", "cannot be combined with offload_opt_states: one "
                                  "offload target per run (DeepSpeed's refusal; at fp32 both would move the masters, "
                                  "which are the shards' storage)", "enable one of them"))
    if compile_config.offload_activation and (compile_config.offload_parameters or compile_config.offload_opt_states):
        raise ConfigError(Problem("compile.offload_activation", "cannot be combined with offload_parameters or "
                                  "offload_opt_states: each plans against the whole memory budget on its own",
                                  "choose one offload target per run"))


def schedule_for(compile_config: CompileConfig) -> list[tuple[int, list[Callable]]]:
    """The default schedule the ``compile`` keys pick (DeepSpeed's ``init_z3``): ``offload_parameters`` moves each
    shard around its uses from step 0 (no prefetch nor selective gather: DeepSpeed's), ``offload_opt_states`` moves the
    optimizer's states from step 1 (they exist after step 0's update; emptied before the profile),
    ``offload_activation`` moves activations from step 0 and plans what stays from ``WARMUP``; else gather/release,
    then prefetch and selective gather from ``WARMUP``."""
    z3 = zero3_compile.add_z3_gather_release
    if compile_config.offload_parameters:
        return [(0, [z3, offload_parameters.offload_parameter_fwd])]
    if compile_config.offload_opt_states:
        return [(0, [z3]), (1, [offload_adam_states.offload_adam_states_for_init, z3,
                                offload_adam_states.move_opt_states])]
    if compile_config.offload_activation:
        return [(0, [z3, offload_activation.offload_activation_floor]),
                (WARMUP, [z3, offload_activation.offload_activation_floor, offload_activation.offload_activation])]
    return default_schedule()


def init_z3(engine: CompilingEngine, backend: str, compile_config: CompileConfig, compile_kwargs: dict[str, Any],
            schedule: Sequence[tuple[int, list]] | None = None) -> None:
    """Compile ``engine.module`` with DeepCompile's ZeRO-3 passes (``engine.compile`` calls this, with the
    config's ``compile`` section); ``schedule`` None: the one the section's keys pick (:func:`schedule_for`)."""
    _check_offload_targets(engine, compile_config, schedule)
    if compile_config.free_activation and backend == "inductor":
        raise ConfigError(Problem("compile.free_activation", "acts with the eager and aot_eager backends (inductor "
                                  "frees its own buffers; DeepSpeed skips the key there)",
                                  "engine.compile(backend='eager'), or drop compile.free_activation"))
    offload_activation.configure(compile_config)
    strategy = engine.strategy
    problem = refusal(strategy)
    if problem is not None:
        raise ConfigError(problem)
    resolved = schedule_for(compile_config) if schedule is None else resolve_schedule(schedule)
    moves_params = any(p is offload_parameters.offload_parameter_fwd for _, passes in resolved for p in passes)
    zc = engine._config.zero_optimization
    prefetch.bucket_numel[0] = max(1, int(zc.stage3_prefetch_bucket_size))
    handle = get_deepcompile_handle()
    handle.cleanup()
    module_numel = strategy.coordinator.largest_fetch_numel() if strategy.reduce_per_module else 0
    intake = strategy.hand_over_to_compiler()
    handle.init(*_reducer(intake.queue, intake.launch_pending, module_numel), wait_reduces=intake.wait_reduces,
                reduces_in_flight=intake.reduces_in_flight, double_buffer=bool(compile_config.double_buffer))
    handle.set_sync_points(**{point: getattr(compile_config, f"sync_{point}") for point in handle.SYNC_POINTS})
    for p in strategy.params:
        p.ds_persist = False
        handle.register_z3_param(p, _resolve_expected_grad_dtype(p))
    strategy.hooks.add("after_update", lambda state: handle.invalidate())  # new shards: kept copies are stale
    if moves_params:  # compile.offload_parameters: the shards move around their uses; the step gets them back
        handle.param_moves = ShardMoves.for_strategy(strategy)
        strategy.recall_shards = handle.param_moves.recall
    opt_state_passes = {offload_adam_states.move_opt_states, offload_adam_states.move_opt_states_sync,
                        offload_adam_states.offload_adam_states_for_init}
    if any(p in opt_state_passes for _, passes in resolved for p in passes):
        offload_adam_states.init_offload_opt_states(offload_adam_states.ZeroOptimizerStates(strategy), handle)
    init_schedule(resolved)
    module = engine.module
    names = {id(p): name for name, p in module.named_parameters()}
    release_engine_state(engine)  # compiled before: what it held of the process-wide state first
    owned: set = set()  # the frames whose backward this engine awaits
    engine._deepcompile_owned_frames = owned
    free_threshold = compile_config.free_activation_threshold if compile_config.free_activation else None
    compiled = torch.compile(gathered_forward(module),
                             backend=DeepCompileBackend(backend, names, bool(compile_config.debug_log), owned,
                                                        free_threshold,
                                                        keep_int_input_tensors=compile_config.keep_int_input_tensors,
                                                        keep_all_input_tensors=compile_config.keep_all_input_tensors),
                             **compile_kwargs)

    def call(*args: object, **kwargs: object) -> Any:
        launch_compile_passes(engine.global_steps, owned_frames=owned)
        return compiled(*args, **kwargs)

    module._compiled_call_impl = call
    engine.launch_compile_passes = lambda steps: launch_compile_passes(steps, owned_frames=owned)
    restore = _allow_dynamo_dynamic_parameter_shapes_for_z3(compile_kwargs)
    if restore is not None:
        engine._deepcompile_dynamo_config_restore = restore
    log_rank0(f"ZeRO-3 in the graph, backend {backend}, {len(strategy.params)} parameters")
