"""``engine.save_checkpoint`` / ``engine.load_checkpoint``: DeepSpeed's files and keys, written atomically.

Save, on every rank (a collective, like DeepSpeed's):

1. the tag (default ``global_step<N>``) is checked to be the same on all ranks (``checkpoint.tag_validation``);
2. rank 0 creates ``save_dir/.<tag>.staging``; every rank writes its files there (each under a temporary name,
   fsynced, renamed), then all meet at a barrier (with ``checkpoint.use_node_local_storage`` each node's local
   rank 0 does what rank 0 does here and in step 3, in its node's own ``save_dir``, and writes the model states
   file too: every node's storage holds a whole checkpoint, DeepSpeed's meaning of the key);
3. rank 0 renames the staging folder to ``save_dir/<tag>`` (a previous copy of the same tag is moved aside to
   ``.<tag>.replaced`` first and deleted after), copies ``zero_to_fp32.py``, and only then rewrites ``latest``
   (temporary file, fsync, rename).

A crash before step 3 leaves ``latest`` and its folder untouched; a crash inside step 3 leaves either the old
or the new complete folder under the tag (the loader also looks in ``.<tag>.replaced``). With
``checkpoint.writer.decoupled`` step 2 captures each rank's files in host memory and a background thread
writes them, agrees with the other ranks and runs step 3 (:mod:`.decoupled`). Load restores the module, the ZeRO optimizer state (resharded when the world size or the stage differ), the
LR scheduler, the loss scale, the step counters and each rank's RNG states, and returns the client state.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from dsrun import comm
from dsrun.io import WriterSettings
from dsrun.ops.cpu_optimizer import adopting_loaded_state
from dsrun.utils import zero_to_fp32 as z2f
from dsrun.utils.errors import Problem, UserError

from . import atomic, decoupled, deepspeed_format, experts, layout, partial_state, reshard, state, universal_checkpoint
from . import autoep_universal, tensor_parallel as tp
from .engine_view import CheckpointEngine, CheckpointStrategy

Tag = str | int | None  # a checkpoint tag as DeepSpeed takes it (str() of it names the folder; None: the default)
from .safe_load import load_file
from .serial_load import one_local_rank_at_a_time
from .tensor_file import has_unread, read_unread
from .saved_tag import optim_files, saved_stage, saved_world, stage0_state

log = logging.getLogger("dsrun.checkpoint")

# Keys DeepSpeed owns in a model states file; everything else is the client's state.
DS_KEYS = frozenset({"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
                     "frozen_param_fragments", "shared_params", "lr_scheduler", "data_sampler", "random_ltd",
                     "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
                     "dp_world_size", "mp_world_size", "ds_config", "ds_version", "dsrun", "compression"})
DS_VERSION = "0.14.1"  # the DeepSpeed layout these files follow


class CheckpointTagError(UserError, AssertionError):
    """Ranks passed different tags to save_checkpoint with ``checkpoint.tag_validation: Fail`` (also an
    AssertionError, which DeepSpeed raises there)."""


def _say(engine: CheckpointEngine, message: str, level: int = logging.INFO) -> None:
    log.log(level, message)
    if engine.global_rank == 0:
        print(f"[dsrun] {message}", flush=True)


def _validate_tag(engine: CheckpointEngine, tag: str) -> tuple[str, list[str]]:
    """Check the tag is the same on every rank (SHA1 compared with a MAX and a MIN all-reduce). Fail raises;
    Warn warns and then every rank uses rank 0's tag, so the files still land in one folder; Ignore lets each
    rank keep its own tag (its files go to that tag's folder, as in DeepSpeed). Returns this rank's tag and
    every rank's, in rank order."""
    mode = str(engine._config.checkpoint.tag_validation).capitalize()
    if engine.world_size == 1:
        return tag, [tag]
    if mode == "Ignore":
        tags: list[Any] = [None] * engine.world_size
        comm.all_gather_object(tags, tag)
        return tag, tags
    digest = torch.tensor(list(hashlib.sha1(tag.encode()).digest()), dtype=torch.int64, device=engine.device)
    high, low = digest.clone(), digest.clone()
    comm.all_reduce(high, op=comm.ReduceOp.MAX)
    comm.all_reduce(low, op=comm.ReduceOp.MIN)
    if torch.equal(high, low):
        return tag, [tag] * engine.world_size
    problem = Problem("save_checkpoint(tag=...)", f"the tag differs across ranks (rank {engine.global_rank} has {tag!r})",
                      "pass the same tag on every rank, or leave it None for global_step<N>")
    if mode == "Fail":
        raise CheckpointTagError(problem)
    chosen = [tag]
    comm.broadcast_object_list(chosen, src=0)
    log.warning("%s; saving under rank 0's tag %r", problem, chosen[0])
    print(f"[dsrun] warning (rank {engine.global_rank}): {problem}; saving under rank 0's tag {chosen[0]!r}", flush=True)
    return chosen[0], [chosen[0]] * engine.world_size


def _node_local(engine: CheckpointEngine) -> bool:
    return bool(engine._config.checkpoint.use_node_local_storage)


def _keeps_the_folder(engine: CheckpointEngine) -> bool:
    """Whether this rank prepares, commits and cleans the checkpoint folder and writes the files one rank writes:
    rank 0, or with ``checkpoint.use_node_local_storage`` each node's local rank 0 (DeepSpeed's ``local_rank``
    then stands for the rank), so that every node's own storage holds a whole checkpoint."""
    return (engine.local_rank if _node_local(engine) else engine.global_rank) == 0


def _on_rank0_then_all(engine: CheckpointEngine, action: Callable[[], object]) -> None:
    """Run ``action`` on rank 0 (with node-local storage: on each node's local rank 0) while the others wait; if
    it fails, every rank raises (instead of the others hanging in the next collective)."""
    error, failure = None, [None]
    if _keeps_the_folder(engine):
        try:
            action()
        except Exception as exc:  # re-raised below, after the other ranks have heard of it
            error, failure[0] = exc, f"{type(exc).__name__}: {exc}"
    if engine.world_size > 1 and _node_local(engine):
        failures: list[Any] = [None] * engine.world_size
        comm.all_gather_object(failures, failure[0])
        failure[0] = next((f for f in failures if f is not None), None)
    elif engine.world_size > 1:
        comm.broadcast_object_list(failure, src=0)
    if error is not None:
        raise error
    if failure[0] is not None:
        raise RuntimeError(f"checkpoint save failed on {'a node' if _node_local(engine) else 'rank 0'}: {failure[0]}")


def _all_ranks_succeeded(engine: CheckpointEngine, error: Exception | None, root: Path, tags: list[str],
                         write_rank_files: Callable[[Path], None]) -> None:
    """A barrier that also tells every rank whether any rank failed, so all raise. After a failure rank 0
    removes the staging folders (a full disk gets its space back, for the logs too); a full disk is one line
    on every rank, with the bytes the save needs (``write_rank_files`` run again, counting instead of
    writing) and the bytes free."""
    flag = torch.tensor([0.0 if error is None else 2.0 if atomic.disk_full(error) else 1.0], device=engine.device)
    if engine.world_size > 1:
        comm.all_reduce(flag, op=comm.ReduceOp.MAX)
    if flag.item() == 0:
        return
    needed = torch.zeros(2, dtype=torch.float64, device=engine.device)  # bytes, ranks that could not count
    if flag.item() == 2:
        try:
            with atomic.counting_bytes() as counted:
                write_rank_files(layout.staging_dir(root, tags[0]))
            needed[0] = counted.bytes
        except Exception:  # noqa: BLE001 - the size is a courtesy; the full disk is the error
            needed[1] = 1
        if engine.world_size > 1:
            comm.all_reduce(needed, op=comm.ReduceOp.SUM)
    line: list[str | None] = [None]
    if _keeps_the_folder(engine):
        for tag in tags:
            atomic.remove_tree(layout.staging_dir(root, tag))
    if engine.global_rank == 0:
        if flag.item() == 2:
            size = f"{int(needed[0].item()):,} bytes needed" if needed[1].item() == 0 else "size unknown"
            kept = layout.read_latest(root)
            line[0] = (f"no space left on device while saving {tags[0]} in {root} ({size}, "
                       f"{shutil.disk_usage(root).free:,} free); nothing of it was kept"
                       + (f", {kept} is still the newest checkpoint" if kept else ""))
    if engine.world_size > 1:
        comm.broadcast_object_list(line, src=0)
    if line[0] is not None:
        raise UserError(Problem("save_checkpoint", line[0], "free space there or save to a bigger disk; "
                                "dsrun train: train.keep_last=N keeps fewer checkpoints")) from error
    if error is not None:
        raise error
    raise RuntimeError("checkpoint save failed on another rank (see its log); nothing was committed")


def _layout(engine: CheckpointEngine) -> layout.CheckpointLayout:
    """The strategy's own file layout (an engine without an optimizer: its configured stage's); refused for
    ZeRO-Inference's engine, whose partitioned weights no file of that layout would carry (no masters)."""
    if engine.strategy is not None:
        return engine.strategy.checkpoint_layout
    if getattr(engine, "parameter_offload", None) is not None:
        raise UserError(Problem("save_checkpoint/load_checkpoint", "a ZeRO-3 engine without an optimizer has no master "
                                "weights to save or load", "use save_16bit_model; load weights before initialize"))
    return layout.layout_for_stage(engine.zero_optimization_stage())


def engine_model_states(engine: CheckpointEngine, client_state: dict[str, Any], exclude_frozen: bool,
                        files: layout.CheckpointLayout, with_module: bool = True) -> dict[str, Any]:
    """What a model states file holds: the module (unless ``with_module`` is False: a pipeline saves it per
    layer), the strategy's shapes (and at stage 0 its optimizer), the scheduler, the counters, the config
    and the client's own keys."""
    strategy = engine.strategy
    stage = files.stage
    sd: dict[str, Any] = {
        # (MoE experts leave it for their own files below)
        "module": state.module_state_cpu(engine.module, exclude_frozen) if with_module else None,
        "buffer_names": state.buffer_names(engine.module),
        # stage 0 has no per-rank optimizer files: its (full) optimizer state lives here, as DeepSpeed does
        "optimizer": (deepspeed_format.stage0_for_deepspeed(strategy.state_dict(), engine.precision.name,
                                                            engine.global_steps, strategy.deepspeed_wrapper,
                                                            getattr(engine.precision, "scaler", None), float(engine.gradient_clipping()))
                      if strategy is not None and files.optimizer_in_model_states else None),
        "param_shapes": strategy.checkpoint_param_shapes() if strategy is not None else None,
        "shared_params": state.shared_params(engine.module),
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "data_sampler": None,
        "random_ltd": None,
        "sparse_tensor_module_names": [],
        "skipped_steps": engine.skipped_steps,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "dp_world_size": engine.dp_world_size,
        "mp_world_size": 1,
        "ds_config": state.plain_config(engine),
        "ds_version": DS_VERSION,
        "dsrun": {"micro_steps": engine.micro_steps, "zero_stage": stage, "precision": engine.precision.name,
                  "state_dict_keys": list(engine.module.state_dict().keys())},
    }
    if sd["module"] is not None and engine.features.parameter_files():  # in files of their own (MoE's experts)
        sd["module"] = experts.without_experts(engine, sd["module"])
    loader = engine.training_dataloader
    if loader is not None and hasattr(loader, "epoch"):
        sd["data_sampler"] = {"epoch": loader.epoch}
    entries = engine.features.checkpoint_entries()  # each feature's own keys (dsrun/features.py)
    sd["dsrun"].update(entries.pop("dsrun", {}))
    sd.update(entries)
    if files.model_states_every_rank:  # partitioned weights: this rank's shards of the frozen ones too
        sd["frozen_param_shapes"], sd["frozen_param_fragments"] = (
            strategy.frozen_param_fragments() if strategy is not None else state.frozen_params(engine.module))
        stored = strategy.frozen_param_messages() if strategy is not None else {}
        if stored:  # frozen shards kept INT8 (zero_quantized_nontrainable_weights): exactly what was held
            sd["dsrun"]["frozen_param_quantized"] = stored
    for key, value in (client_state or {}).items():
        if key in DS_KEYS or key in entries:
            raise UserError(Problem(f"save_checkpoint(client_state[{key!r}])", "is a key DeepSpeed's checkpoint "
                                    "owns", "rename it"))
        sd[key] = value
    return sd


def save_checkpoint(engine: CheckpointEngine, save_dir: str, tag: Tag = None,
                    client_state: dict[str, Any] | None = None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False) -> bool:
    """Save the engine's full training state under ``save_dir/<tag>``; every rank must call it."""
    rank, dp_rank, mp_rank = engine.global_rank, comm.get_rank(engine.dp_group), engine.groups.coord("model")
    files = _layout(engine)

    def write(staging: Path) -> None:
        # use_node_local_storage: each node's local rank 0 writes the one-rank files, as DeepSpeed's local_rank
        if files.writes_model_states(engine.local_rank if _node_local(engine) else dp_rank):
            atomic.save_torch(engine_model_states(engine, client_state or {}, exclude_frozen_parameters, files),
                              staging / files.model_states_name(dp_rank, mp_rank), rank, torn_point="model_states_torn")
        atomic.crash_point("after_model_states", rank)
        experts.save(engine, staging, rank)  # features' own files: MoE's, one per expert (collective per group)
        if engine.strategy is not None and files.optimizer_file_per_rank:
            save_optimizer_states(engine, staging / layout.optim_states_name(dp_rank, engine.bfloat16_enabled(), mp_rank))
        rank_state = engine.strategy.rank_state_dict() if engine.strategy is not None else None
        if rank_state is not None:  # optimizer state that differs per data-parallel rank (1-bit error buffers)
            atomic.save_torch(rank_state, staging / layout.rank_states_name(dp_rank), rank)
        atomic.save_torch(state.capture_rng_state(), staging / layout.rng_states_name(rank), rank)
        atomic.crash_point("after_optim_states", rank)

    return save_staged(engine, save_dir, tag, write, save_latest)


def save_optimizer_states(engine: CheckpointEngine, path: Path) -> None:
    """This rank's ZeRO optimizer file, with the keys DeepSpeed's ZeRO optimizers also read (its loss scaler
    is written as a reference to DeepSpeed's class, see :mod:`.deepspeed_format`)."""
    sd = deepspeed_format.zero_state_for_deepspeed(engine.strategy.state_dict(), engine.precision.name, float(engine.gradient_clipping()),
                                                   getattr(engine.precision, "scaler", None), engine.zero_elastic_checkpoint())
    optim = {"optimizer_state_dict": sd, "ds_config": state.plain_config(engine), "ds_version": DS_VERSION}
    pickler = deepspeed_format.PICKLE_MODULE if deepspeed_format.holds_foreign(sd) else None
    atomic.save_torch(optim, path, engine.global_rank, pickle_module=pickler)


def save_staged(engine: CheckpointEngine, save_dir: str, tag: Tag, write_rank_files: Callable[[Path], None],
                save_latest: bool) -> bool:
    """The save protocol (module docstring): check the tag, stage, let every rank write its files into the
    staging folder (``write_rank_files(staging)``), agree that all succeeded, commit, update ``latest``. With
    ``checkpoint.writer.decoupled`` the files are captured in host memory instead and written and committed in
    the background (:mod:`.decoupled`); False when that save was skipped (a write still in flight)."""
    root = _checkpoint_dir(save_dir, "save_checkpoint(save_dir=...)")
    rank = engine.global_rank
    tag = layout.check_tag(str(tag) if tag is not None else layout.default_tag(engine.global_steps))
    tag, all_tags = _validate_tag(engine, tag)
    tags = list(dict.fromkeys(all_tags))  # distinct, rank 0's first
    staging = layout.staging_dir(root, tag)
    writer = decoupled.writer() if decoupled.enabled(engine._config.checkpoint) else None
    if writer is not None:
        skipped = writer.take_turn(engine.device)  # the save in flight first: its staging folder must survive prepare()
        if skipped is not None:
            _say(engine, f"warning: checkpoint {tag} skipped: {skipped}", logging.WARNING)
            return False

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        for leftover in layout.repair(root):  # from saves that crashed
            if leftover.is_dir():
                atomic.remove_tree(leftover)
            else:
                leftover.unlink(missing_ok=True)
        for each in tags:
            layout.staging_dir(root, each).mkdir()

    _on_rank0_then_all(engine, prepare)
    atomic.crash_point("staging_created", rank)

    error = None
    snapshot = writer.snapshot() if writer is not None else None
    settings = WriterSettings.from_config(engine._config.checkpoint.writer, engine._config.aio)
    legacy = not engine._config.checkpoint.checkpoint_serialization  # torch's legacy format, as DeepSpeed's engine
    capture = atomic.capturing_writes(snapshot) if snapshot is not None else contextlib.nullcontext([])
    with atomic.writing_with(settings), atomic.legacy_serialization(legacy), capture as captured:
        try:
            write_rank_files(staging)
        except Exception as exc:  # e.g. a full disk: every rank must learn of it, or the others wait forever
            error = exc
        if snapshot is not None:
            snapshot.finish()
    _all_ranks_succeeded(engine, error, root, tags, write_rank_files)

    def commit() -> None:
        _publish(root, tags, rank, save_latest)

    def discard() -> None:
        for each in tags:
            atomic.remove_tree(layout.staging_dir(root, each))

    if writer is not None:
        writer.submit(decoupled.SaveJob(tag, root, rank, captured, snapshot, publish=commit, discard=discard))
        return True
    _on_rank0_then_all(engine, commit)
    return True


def _publish(root: Path, tags: list[str], rank: int, save_latest: bool) -> None:
    """Rank 0's commit: each tag's staging folder into place, ``zero_to_fp32.py``, then ``latest``."""
    atomic.crash_point("before_commit", rank)
    for each in tags:
        _commit_tag(root, each, rank)
    atomic.copy_file(Path(z2f.__file__), root / layout.ZERO_TO_FP32)
    if save_latest:  # rank 0's tag, as DeepSpeed's rank 0 writes it
        atomic.write_text(root / layout.LATEST, tags[0], rank, crash_before_rename="latest_tmp_written")
    atomic.crash_point("after_latest", rank)


def _commit_tag(root: Path, tag: str, rank: int) -> None:
    """Rename ``tag``'s staging folder into place (an older copy of the tag is set aside, then deleted)."""
    staging = layout.staging_dir(root, tag)
    atomic.fsync_dir(staging)
    final, replaced = root / tag, layout.replaced_dir(root, tag)
    atomic.remove_tree(replaced)
    if final.exists():
        final.rename(replaced)
        atomic.crash_point("old_tag_moved_aside", rank)
    staging.rename(final)
    atomic.fsync_dir(root)
    atomic.remove_tree(replaced)
    atomic.crash_point("after_commit", rank)


def _checkpoint_dir(path: str | os.PathLike[str] | None, argument: str) -> Path:
    """The checkpoint folder a save or load names; None or "" is a ValueError on every rank (before any
    collective, so no rank is left waiting)."""
    if path is None or str(path).strip() == "":
        raise ValueError(f"{argument}: got {path!r}; pass the checkpoint folder, e.g. 'checkpoints'")
    return Path(path)


# --- load -----------------------------------------------------------------------------------------------
def _refuse_reshard(strategy: CheckpointStrategy, tag_dir: Path, saved: str) -> None:
    """A strategy whose layout cannot be resharded into (MiCS: masters cut over shard groups) refuses."""
    refusal = strategy.checkpoint_layout.reshard_refusal
    if refusal is not None:
        raise RuntimeError(f"{tag_dir}: {refusal} loads only a checkpoint of its own layout (saved: {saved}); load "
                           "the zero_to_fp32 weights into the model instead")


def _load_module(engine: CheckpointEngine, module_sd: dict[str, Any], strict: bool, tag_dir: Path,
                 custom_load_fn: Callable[..., object] | None = None, model_path: Path | None = None,
                 model_states: dict[str, Any] | None = None) -> None:
    if custom_load_fn is not None:
        # the client's loader gets full values: a stage-3 checkpoint's placeholders are its fp32 masters
        empty = [n for n, v in module_sd.items() if torch.is_tensor(v) and v.numel() == 0]
        if empty:
            full = z2f.get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag_dir.name)
            module_sd = {**module_sd, **{k: full[k] for k in empty if k in full}}
        engine.load_module_state_dict({"module": module_sd}, strict=strict, custom_load_fn=custom_load_fn,
                                      fetch_z3_params=_layout(engine).module_holds_placeholders)
        return
    if _layout(engine).module_holds_placeholders:
        # partitioned parameters are restored through the strategy's master weights; only buffers load here
        with torch.no_grad():
            for name, buf in engine.module.named_buffers():
                if name in module_sd:
                    buf.copy_(module_sd[name])
        return
    if model_path is not None and has_unread(module_sd):  # each tensor into its live tensor, no second copy
        module_sd = partial_state.read_module_into(engine.module, module_sd, model_path)
    live = engine.module.state_dict()
    params_missing = [n for n, v in module_sd.items() if v.numel() == 0 and n in live and live[n].numel() > 0]
    if params_missing:  # a stage-3 checkpoint: placeholders only; the weights come with the master weights
        module_sd = {k: v for k, v in module_sd.items() if k not in params_missing}
        strict = False
    engine.module.load_state_dict(module_sd, strict=strict)
    if params_missing and engine.strategy is None:  # no optimizer to carry them: the fp32 masters, by range
        with partial_state.saved_fp32(tag_dir, model_path or tag_dir, model_states or {}, engine.bfloat16_enabled(),
                                      engine.groups.coord("model")) as masters:
            partial_state.read_fp32_into(engine.module, params_missing, masters)


def _restore_strategy(engine: CheckpointEngine, tag_dir: Path, model_states: dict[str, Any], load_optimizer_states: bool,
                      masters_from_module: bool, model_path: Path) -> None:
    """Load the ZeRO strategy's masters and optimizer state: the rank's own file when the layout matches,
    else resharded (from every saved rank's file, or from a universal folder's per-parameter files).
    ``masters_from_module``: a weights-only load whose module was filled by the client's ``custom_load_fn``
    keeps the masters that followed it. A stage-0 save's optimizer state, in ``model_path``, is read whole here
    where the load needs all of it, else by range."""
    strategy = engine.strategy
    live_stage, live_world = strategy.stage, engine.dp_world_size
    stage_saved, world_saved = saved_stage(model_states, tag_dir), saved_world(model_states)
    live_shapes = strategy.checkpoint_param_shapes()
    dp_rank = comm.get_rank(engine.dp_group)
    if universal_checkpoint.is_universal(tag_dir):
        if not load_optimizer_states and masters_from_module:
            return
        _refuse_reshard(strategy, tag_dir, "a universal checkpoint")
        _say(engine, f"loading universal checkpoint {tag_dir.name} (saved by {world_saved} rank(s) at ZeRO stage "
                     f"{stage_saved}) into {live_world} rank(s) at stage {live_stage}")
        with partial_state.PartialUniversalState(tag_dir) as full:  # this rank's ranges of each parameter's files
            source = tp.universal_rank_source(full, model_states.get("param_shapes"), tp.splits_of(
                engine.features.checkpoint_entries()), engine.groups.coord("model"), engine.groups.size("model"))
            _load_cut(strategy, source, live_stage, live_world, dp_rank, live_shapes, tag_dir, world_saved,
                      load_optimizer_states)
        return
    saved_shapes = model_states.get("param_shapes")
    deepspeed_stage0 = stage_saved == 0 and deepspeed_format.is_deepspeed_stage0(model_states.get("optimizer"))
    if saved_shapes is None and deepspeed_stage0:
        saved_shapes = live_shapes  # DeepSpeed's stage 0 names no parameter: they are the live model's, in order
    # the same masters, cut the same way (stage 3's sub_group_size may differ between the runs)
    same_grouping = saved_shapes is None or [list(s) for s in saved_shapes] == [list(s) for s in live_shapes]
    same_layout = (stage_saved == live_stage and world_saved == live_world and same_grouping
                   and not engine._config.checkpoint.load_universal)
    # each rank's own file holds the state of the features' own files (experts) only if it sits where it did
    same_layout = same_layout and engine.features.checkpoint_layout_matches(model_states)
    if not (same_layout and load_optimizer_states) and not (masters_from_module and not load_optimizer_states):
        _refuse_reshard(strategy, tag_dir, f"stage {stage_saved} on {world_saved} ranks")
    if engine.features.parameter_files() and not (same_layout and live_stage > 0 and load_optimizer_states):
        # parameters in files of their own (MoE: experts by global id) from their files (stage 0 keeps only rank 0's state in its one file); weights
        # only (load_optimizer_states=False, load_module_only): their fp32 masters, the live optimizer state kept
        if saved_shapes is None:
            raise RuntimeError(f"{tag_dir}: this MoE checkpoint has no 'param_shapes' (saved without a ZeRO "
                               "optimizer): its experts cannot be placed by global id")
        with adopting_loaded_state():  # the cut state is this load's alone: the optimizer keeps it, no second copy
            strategy.load_state_dict(experts.optimizer_state(engine, tag_dir, saved_shapes, model_states, stage_saved,
                                                             world_saved, model_path, load_optimizer_states))
        return
    if load_optimizer_states and same_layout:
        # node-local storage holds this node's ranks' optimizer files only: this rank's is the one it needs
        bf16, own_only = engine.bfloat16_enabled(), _node_local(engine)
        partial_state.read_stage0_state(model_path, model_states)
        own = (stage0_state(model_states, live_shapes) if stage_saved == 0 else deepspeed_format.load_zero_state(
            optim_files(tag_dir, world_saved, bf16, only=dp_rank if own_only else None,
                        mp_rank=engine.groups.coord("model"))[0 if own_only else dp_rank]))
        if reshard.loads_as_saved(own, strategy.param_alignment_paddings) or engine.features.parameter_files():
            strategy.load_state_dict(own)
            return partial_state.restore_rank_states(strategy, tag_dir, world_saved, dp_rank, same_layout=True)
    if load_optimizer_states and saved_shapes is not None:
        _say(engine, f"resharding checkpoint {tag_dir.name}: saved by {world_saved} rank(s) at ZeRO stage "
                     f"{stage_saved}, loading into {live_world} rank(s) at stage {live_stage}")
        if stage_saved > 0 or partial_state.left_unread(model_states):  # the rank's elements by range (checkpoint.md)
            with partial_state.saved_state(tag_dir, model_path, stage_saved, world_saved, saved_shapes, deepspeed_stage0,
                                           engine.bfloat16_enabled(), engine.groups.coord("model")) as source:
                _load_cut(strategy, source, live_stage, live_world, dp_rank, live_shapes, tag_dir, world_saved)
            return
        full = reshard.merge_rank_states([stage0_state(model_states, live_shapes)], 0, saved_shapes)
    elif masters_from_module:
        return
    else:  # weights only (load_module_only / load_optimizer_states=False): the fp32 masters by range, optimizer kept
        with partial_state.saved_fp32(tag_dir, model_path, model_states, engine.bfloat16_enabled(),
                                      engine.groups.coord("model")) as masters:
            _load_cut(strategy, masters, live_stage, live_world, dp_rank, live_shapes, tag_dir, world_saved, False)
        return
    _load_cut(strategy, full, live_stage, live_world, dp_rank, live_shapes, tag_dir, world_saved,
              load_optimizer_states)


def _load_cut(strategy: CheckpointStrategy, full: reshard.StateSource, stage: int, world: int, dp_rank: int,
              shapes: list[Any], tag_dir: Path, world_saved: int, load_optimizer_states: bool = True) -> None:
    """Load ``full`` cut to this rank's layout into the strategy (and re-cut the per-rank optimizer files)."""
    template = reshard.master_sizes_only(strategy.state_dict())
    with adopting_loaded_state():  # the cut state is this load's alone: the optimizer keeps it, no second copy
        strategy.load_state_dict(reshard.state_for_rank(template, full, stage, world, dp_rank, shapes,
                                                        load_optimizer_states=load_optimizer_states))
    if load_optimizer_states:
        partial_state.restore_rank_states(strategy, tag_dir, world_saved, dp_rank, same_layout=False)


def find_tag_dir(engine: CheckpointEngine, load_dir: str, tag: Tag) -> Path | None:
    """The folder of ``tag`` (None: the one ``latest`` names, or ``latest_universal`` first with
    ``checkpoint.load_universal``) under ``load_dir``; None, with DeepSpeed's warning, when there is no ``latest``."""
    root = _checkpoint_dir(load_dir, "load_checkpoint(load_dir=...)")
    if tag is None and bool(engine._config.checkpoint.load_universal):
        tag = universal_checkpoint.read_latest_universal(root)
    if tag is None:
        tag = layout.read_latest(root)
        if tag is None:
            _say(engine, f"warning: Unable to find latest file at {root / layout.LATEST}, if trying to load latest "
                         "checkpoint please ensure this file exists or pass an explicit checkpoint tag when loading a "
                         "checkpoint.", logging.WARNING)
            return None
    tag_dir = layout.resolve_tag_dir(root, str(tag))
    if tag_dir is None:
        raise FileNotFoundError(f"checkpoint tag folder {root / str(tag)} does not exist "
                                f"(tags here: {', '.join(layout.list_tags(root)) or 'none'})")
    return tag_dir


def load_checkpoint(engine: CheckpointEngine, load_dir: str, tag: Tag = None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, custom_load_fn: Callable[..., object] | None = None
                    ) -> tuple[str | None, dict[str, Any] | None]:
    """Restore a checkpoint saved by :func:`save_checkpoint` (or converted by ``ds_to_universal``); returns
    ``(load_path, client_state)`` (the model states file read, the saved keys not DeepSpeed's), or ``(None, None)``
    (a warning) when ``tag`` is None and ``load_dir`` has no ``latest``; ``checkpoint.load_universal``: a tag-less load
    reads ``latest_universal`` if any. ``custom_load_fn(src=state_dict, dst=module)`` loads the module instead of
    ``load_state_dict``. A decoupled save being written is waited for; a folded AutoEP-over-AutoTP save is refused."""
    decoupled.drain()
    tag_dir = find_tag_dir(engine, load_dir, tag)
    if tag_dir is None:
        return None, None
    stage_files = sorted(tag_dir.glob("zero_pp_rank_*_model_states.pt"), key=lambda p: z2f.natural_key(p.name))
    dp_rank = comm.get_rank(engine.dp_group)
    if stage_files:  # this data rank's file of this tensor-parallel rank
        own = tag_dir / layout.model_states_name(3, dp_rank, engine.groups.coord("model"))
        model_path = own if own.is_file() else stage_files[0]
    else:  # this tensor-parallel rank's file; a checkpoint of fewer (a universal folder: one) has rank 0's
        own = tag_dir / layout.model_states_name(0, 0, engine.groups.coord("model"))
        model_path = own if own.is_file() else tag_dir / layout.model_states_name(0, 0)
    unread: set[str] = set()  # a stage-0 save's optimizer state is left unread there too (read by range or whole)
    if custom_load_fn is None and engine.strategy is not None and _layout(engine).module_holds_placeholders \
            and not engine.features.parameter_files():  # the parameters come through the masters: leave them unread
        unread = {name for name, _ in engine.module.named_parameters(remove_duplicate=False)}
    # stages 0-2: the module's tensors are read straight into the live module's (_load_module), not copied twice
    module_unread = (custom_load_fn is None and not _layout(engine).module_holds_placeholders
                     and partial_state.reads_into(engine.module))
    model_states = partial_state.model_states_without_parameters(model_path, unread, module_unread)
    autoep_universal.check_folding_record(model_states, folding_spec=None)  # dsrun does not fold AutoEP over AutoTP
    if module_unread and tp.saved_degree(model_states) != engine.groups.size("model"):  # merged and cut again
        model_states["module"] = read_unread(model_path, model_states["module"])
    # AutoTP saved at another degree: the module merged and cut for this rank; the masters follow it (other_degree)
    module_sd, other_degree = tp.module_for_live_degree(tag_dir, model_states, tp.splits_of(
        engine.features.checkpoint_entries()), engine.groups.coord("model"), engine.groups.size("model"),
        with_optimizer=load_optimizer_states and not load_module_only)
    if engine.features.parameter_files():  # parameters in files of their own (MoE: this rank's experts, by id)
        module_sd = experts.module_state(engine, tag_dir, module_sd, unread=module_unread)
    _load_module(engine, module_sd, load_module_strict, tag_dir, custom_load_fn, model_path, model_states)
    if _layout(engine).module_holds_placeholders and saved_world(model_states) == engine.dp_world_size:
        engine.restore_frozen_shards(model_states)  # frozen shards: not in the masters, restored from this file
    if engine.strategy is not None:
        with one_local_rank_at_a_time(bool(engine._config.zero_optimization.pipeline_loading_checkpoint)):
            _restore_strategy(engine, tag_dir, model_states, load_optimizer_states and not load_module_only,
                              custom_load_fn is not None or other_degree, model_path)
        if (other_degree or not engine._config.zero_optimization.load_from_fp32_weights) \
                and engine.zero_optimization_stage() > 0:
            engine.restore_masters_from_model()  # the masters from the 16-bit weights just loaded, as DeepSpeed
    engine.loaded_checkpoint_dp_world_size = saved_world(model_states)
    engine.loaded_checkpoint_mp_world_size = int(model_states.get("mp_world_size", 1))
    if not load_module_only:
        restore_training_state(engine, model_states, tag_dir, load_lr_scheduler_states,
                               same_world=saved_world(model_states) == engine.dp_world_size)
    client_state = client_state_of(engine, model_states)
    return str(model_path), client_state


def client_state_of(engine: CheckpointEngine, model_states: dict[str, Any]) -> dict[str, Any]:
    """The keys a client saved: neither DeepSpeed's nor a feature's."""
    owned = DS_KEYS | set(engine.features.checkpoint_entries())
    return {k: v for k, v in model_states.items() if k not in owned}


def restore_training_state(engine: CheckpointEngine, model_states: dict[str, Any], tag_dir: Path, load_lr_scheduler_states: bool,
                           same_world: bool) -> None:
    """The scheduler, the step counters, the loader's epoch and (when the ranks are laid out as when saved)
    this rank's RNG states."""
    if load_lr_scheduler_states and engine.lr_scheduler is not None and model_states.get("lr_scheduler"):
        engine.lr_scheduler.load_state_dict(model_states["lr_scheduler"])
    engine.global_steps = int(model_states.get("global_steps", 0))
    engine.global_samples = int(model_states.get("global_samples", engine.global_steps * engine.train_batch_size()))
    engine.skipped_steps = int(model_states.get("skipped_steps", 0))
    extras = model_states.get("dsrun") or {}
    engine.micro_steps = int(extras.get("micro_steps", engine.global_steps * engine.gradient_accumulation_steps()))
    if not same_world:  # the accumulation steps may differ: restart at a boundary
        engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    loader = engine.training_dataloader
    if loader is not None and isinstance(model_states.get("data_sampler"), dict) and hasattr(loader, "epoch"):
        loader.epoch = int(model_states["data_sampler"].get("epoch", loader.epoch))
    engine.features.load_checkpoint_entries(model_states)  # each feature's own keys (dsrun/features.py)
    rng_file = tag_dir / layout.rng_states_name(engine.global_rank)
    if same_world and rng_file.is_file():
        state.restore_rng_state(load_file(rng_file))
    elif engine.global_rank == 0:
        _say(engine, "note: random number generator states not restored (the world size changed, or the "
                     "checkpoint has none for this rank)")
