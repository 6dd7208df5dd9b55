"""Estimate the memory a recipe needs, per rank and per host, before launching it.

  dsrun estimate-memory +recipe=gpt_zero3 launcher.num_procs=4     # a recipe, with Hydra overrides
  dsrun estimate-memory --total-params 2.851e9 --largest-layer-params 3.2e7 --gpus-per-node 8 --nodes 1
  dsrun estimate-memory +recipe=gpt_zero2 --measure    # also train 3 steps and compare each rank's peak

The model is built on the meta device (no weights are allocated), so a 10B-parameter model takes about a
second. Prints DeepSpeed's ZeRO-2 and ZeRO-3 model-state tables (identical to DeepSpeed's estimators),
then dsrun's estimate for every ZeRO stage x offload option: parameters, gradients, optimizer states,
activations (with and without activation checkpointing), communication buffers, the peak per rank and
per host, and a verdict against this machine's memory. See docs/estimate.md for the formulas.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsrun.utils.errors import Problem, UserError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from dsrun.estimate import Breakdown
    from dsrun.estimate.inputs import EstimateInputs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE",
                        help="Hydra overrides selecting and changing the recipe (e.g. +recipe=gpt_zero3)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    cold = parser.add_argument_group("without a model (DeepSpeed's 'cold' estimate)")
    cold.add_argument("--total-params", type=float, help="total parameters, e.g. 2.851e9 (skips the recipe)")
    cold.add_argument("--largest-layer-params", type=float,
                      help="parameters of the largest layer (default: total / 100)")
    cold.add_argument("--gpus-per-node", type=int, help="ranks per node (overrides the recipe's launcher)")
    cold.add_argument("--nodes", type=int, help="number of nodes (overrides the recipe's launcher)")
    cold.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=None,
                      help="the ZeRO stage to mark as chosen (default 3 without a recipe)")
    cold.add_argument("--precision", choices=("fp32", "fp16", "bf16"), help="default fp16 without a recipe")
    cold.add_argument("--optimizer", help="optimizer type (default Adam without a recipe)")
    cold.add_argument("--micro-batch", type=int, help="micro batch size per rank (default 1)")
    cold.add_argument("--seq-len", type=int, help="sequence length (default 1024)")
    cold.add_argument("--activation-checkpointing", default=None, metavar="MODE", type=_checkpoint_mode,
                      help="the checkpointing mode: none, full, every_N or selective (with a recipe: its "
                           "model.activation_checkpointing unless given)")
    for name in ("n-layer", "n-embd", "n-head", "vocab-size"):
        cold.add_argument(f"--{name}", type=int, help="GPT shape, for the activation estimate")
    measure = parser.add_argument_group("predicted vs measured")
    measure.add_argument("--measured", metavar="PATH",
                         help="compare with measured peaks: a run directory holding memory_peak_rank*.json files, "
                              "or a JSON file {\"peak_bytes_per_rank\": {\"0\": BYTES, ...}}")
    measure.add_argument("--measure", action="store_true",
                         help="train the recipe for a few steps (dsrun train) and compare each rank's peak "
                              "with the prediction")
    measure.add_argument("--measure-steps", type=int, default=3, help="optimizer steps of the measured run")
    measure.add_argument("--measure-timeout", type=float, default=600, help="seconds before the run is stopped")
    measure.add_argument("--tolerance", type=float, default=15.0, help="allowed error in percent (default 15)")
    process = parser.add_argument_group("the rank process")
    process.add_argument("--rank-runtime", type=float, metavar="BYTES",
                         help="resident memory of an idle rank (interpreter, torch, dsrun, process group, "
                              "optimizer machinery); default: measured once on this host by a small "
                              "subprocess and cached; 0 leaves it out")
    process.add_argument("--refresh-runtime", action="store_true",
                         help="measure the idle rank again instead of using the cached figure (--measure does "
                              "this itself: it compares with a run made now)")
    process.add_argument("--device", choices=("cpu", "cuda"),
                         help="where ranks compute (default: cuda if this host has it, else cpu)")
    parser.add_argument("--recipes-dir", action="append", default=[], metavar="DIR",
                        help="an extra folder of recipes (repeatable)")
    # Hydra overrides and flags may come in any order.
    parser.parse_args = parser.parse_intermixed_args  # type: ignore[method-assign]


def _checkpoint_mode(value: str) -> str:
    from dsrun.activation_checkpointing.modes import CheckpointMode
    from dsrun.utils.errors import ConfigError

    try:
        return str(CheckpointMode.parse(value, "--activation-checkpointing"))
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err.problems[0]).split(": ", 1)[1]) from None


def _positive(value: float | None, flag: str) -> int | None:
    if value is None:
        return None
    if value < 0 or value != int(value):
        raise UserError(Problem(flag, f"must be a non-negative whole number, got {value:g}"))
    return int(value)


def _cold_inputs(args: argparse.Namespace) -> tuple[Any, dict[str, Any], dict[str, str]]:
    from dsrun.estimate.inputs import EstimateInputs, GPTShape

    total = _positive(args.total_params, "--total-params")
    largest = _positive(args.largest_layer_params, "--largest-layer-params")
    shape_args = [args.n_layer, args.n_embd, args.n_head, args.vocab_size]
    shape = None
    if any(v is not None for v in shape_args):
        if not all(v is not None for v in shape_args):
            raise UserError(Problem("--n-layer/--n-embd/--n-head/--vocab-size",
                                    "give all four to estimate activations, or none"))
        shape = GPTShape(*shape_args)
    spec = EstimateInputs(
        total_params=total, largest_layer_params=largest if largest is not None else total // 100,
        ranks_per_node=args.gpus_per_node or 1, nodes=args.nodes or 1,
        zero_stage=3 if args.stage is None else args.stage, precision=args.precision or "fp16",
        optimizer=args.optimizer or "adam", micro_batch_size=args.micro_batch or 1,
        seq_len=args.seq_len or 1024, activation_checkpointing=args.activation_checkpointing or "none",
        model_shape=shape)
    sources = {"total_params": "--total-params",
               "largest_layer_params": "--largest-layer-params" if largest is not None else "total / 100"}
    return spec, {"name": "(given counts)"}, sources


def _planned_layout(cfg: DictConfig) -> tuple[int, int, str] | None:
    """(nodes, ranks on the busiest node, source) from the launcher's plan, which reads hostfiles and
    filters too; None when no launcher is available in this build."""
    try:
        from dsrun.launcher import plan_from_mapping
    except ImportError:
        return None
    from omegaconf import OmegaConf

    launcher = cfg.get("launcher")
    mapping = OmegaConf.to_container(launcher, resolve=True) if launcher is not None else None
    plan = plan_from_mapping(mapping, "dsrun.worker", module=True)
    slots = [len(s) for s in plan.hosts.values()] or [plan.world_size]
    return len(slots), max(slots), f"launch plan ({plan.world_size} ranks on {len(slots)} host(s))"


def _recipe_inputs(args: argparse.Namespace) -> tuple[EstimateInputs, dict[str, Any], dict[str, str]]:
    try:
        from dsrun.compose import compose_runspec
    except ImportError:
        raise UserError(Problem("estimate-memory", "recipe composition is not available in this build",
                                "pass --total-params (and --largest-layer-params) instead")) from None
    from dsrun.estimate.runspec import build_recipe_model, inputs_from_runspec
    from dsrun.tensor_parallel.spec_split import meta_split_for

    cfg = compose_runspec(list(args.overrides), recipes_dirs=tuple(args.recipes_dir))
    model = build_recipe_model(cfg, split=meta_split_for(cfg))  # with AutoTP: one rank's share
    spec, sources = inputs_from_runspec(cfg, model)
    changes: dict[str, Any] = {}
    layout = _planned_layout(cfg)
    if layout is not None:
        changes["nodes"], changes["ranks_per_node"], sources["nodes"] = layout
        sources["ranks_per_node"] = sources["nodes"]
    for flag, field_name in (("gpus_per_node", "ranks_per_node"), ("nodes", "nodes"), ("stage", "zero_stage"),
                             ("precision", "precision"), ("optimizer", "optimizer"),
                             ("micro_batch", "micro_batch_size"), ("seq_len", "seq_len"),
                             ("activation_checkpointing", "activation_checkpointing")):
        value = getattr(args, flag)
        if value is not None:
            changes[field_name] = value
            sources[field_name] = "--" + flag.replace("_", "-")
    if changes:
        spec = spec.with_(**changes)
    target = cfg["model"]["_target_"]
    from omegaconf import OmegaConf

    info = {"name": str(target), "largest_layer_name": model.counts.largest_layer_name,
            "moe_total": model.counts.moe_total, "moe_active": model.counts.moe_active,
            "config": OmegaConf.to_container(cfg["model"], resolve=True),
            "ds": OmegaConf.to_container(cfg["ds"], resolve=True)}
    return spec, info, sources


def _with_process(spec: EstimateInputs, args: argparse.Namespace, sources: dict[str, str], threads: int | None = None,
                  model_cfg: dict | None = None, ds_cfg: dict | None = None) -> EstimateInputs:
    """Add what the rank process itself holds: the device kind and the idle rank's measured memory
    (with ``threads`` OpenMP threads, default what dsrun's launcher gives each rank on this host, and the
    recipe's model class ``model_cfg``; probed afresh with ``--refresh-runtime`` or ``--measure``)."""
    import torch

    from dsrun.estimate.runtime import enabled_monitors, measure_rank_runtime, rank_threads

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sources["device"] = "--device" if args.device else "this host"
    if args.rank_runtime is not None:
        runtime, monitor_bytes = _positive(args.rank_runtime, "--rank-runtime"), 0  # the whole process, given
        sources["rank_runtime_bytes"] = "--rank-runtime"
    else:
        from dsrun.estimate.model_states import optimizer_state_count

        optimizer_state_count(spec.optimizer, spec.optimizer_params)  # an unknown optimizer: one clear error first
        threads = threads or rank_threads(spec.ranks_per_node)
        monitors = enabled_monitors(ds_cfg)
        refresh = bool(getattr(args, "refresh_runtime", False) or getattr(args, "measure", False))
        probe = measure_rank_runtime(threads, spec.optimizer, model_cfg, spec.precision, refresh=refresh,
                                     monitors=monitors)
        runtime, monitor_bytes = probe.resident, probe.monitors
        sources["rank_runtime_bytes"] = (f"measured: a rank with a tiny model of the same class, {spec.optimizer}, "
                                         f"{spec.precision}, {threads} thread(s)"
                                         + f"; torch {probe.torch} on {probe.host} ({probe.age_text()})")
        if monitors:
            sources["monitor_bytes"] = f"measured: rank 0's monitors ({', '.join(monitors)}) opened by the same probe"
    return spec.with_(device=device, rank_runtime_bytes=int(runtime), monitor_bytes=int(monitor_bytes))


def estimate_recipe(overrides: list[str], recipes_dirs: tuple[str, ...] = (), threads: int | None = None) -> Breakdown:
    """The estimate ``dsrun estimate-memory OVERRIDES`` prints for the recipe's own setting, as a
    :class:`~dsrun.estimate.Breakdown` (``rank_peak`` is what ``--measure`` compares with each rank)."""
    from dsrun.estimate import estimate_peak_bytes_per_rank

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([*overrides, *[a for d in recipes_dirs for a in ("--recipes-dir", str(d))]])
    spec, info, sources = _recipe_inputs(args)
    return estimate_peak_bytes_per_rank(_with_process(spec, args, sources, threads, info.get("config"),
                                                      info.get("ds")))


def measure_run(overrides: list[str], recipes_dirs: list[str], steps: int, timeout: float,
                run_dir: Path) -> dict[int, int]:
    """Train the recipe for ``steps`` optimizer steps in ``run_dir`` (``dsrun train``, as a user would) and
    read back the peak each rank recorded there (``memory_peak_rank<r>.json``)."""
    import os
    import subprocess
    import sys

    from dsrun.estimate.measure import load_measured_peaks

    command = [sys.executable, "-m", "dsrun", "train", *overrides,
               *[arg for d in recipes_dirs for arg in ("--recipes-dir", d)],
               f"train.max_steps={steps}", "train.eval_interval=0", "train.eval_iters=1", "train.save_interval=0",
               f"hydra.run.dir={run_dir}"]
    # glibc then returns large blocks to the system at once, so a rank's peak RSS tracks its tensors.
    from dsrun.estimate.runtime import malloc_threshold

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": malloc_threshold()}
    try:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout,
                                stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise UserError(Problem("--measure", f"the measured run did not finish in {timeout:g}s",
                                "raise --measure-timeout or lower --measure-steps")) from None
    if result.returncode != 0:
        tail = " | ".join((result.stderr or result.stdout).strip().splitlines()[-3:])
        raise UserError(Problem("--measure", f"the measured run failed with exit code {result.returncode}: {tail}"))
    return load_measured_peaks(run_dir)


def _pipeline_stages(spec: EstimateInputs, model_spec: dict[str, Any], ds_cfg: dict[str, Any]) -> list | None:
    """Each stage's estimate when the recipe's GPT is pipelined (``model.pipeline_stages`` > 1), else None."""
    if int(model_spec.get("pipeline_stages", 1) or 1) <= 1:
        return None
    from dsrun.config import load_ds_config
    from dsrun.workloads.pipeline_memory import pipeline_stage_memory

    stages = int(model_spec["pipeline_stages"])
    world = spec.ranks_per_node * spec.nodes
    ds = load_ds_config(ds_cfg, world_size=max(1, world // stages))
    return pipeline_stage_memory(spec, model_spec, ds)


def run(args: argparse.Namespace) -> int:
    if args.measure and args.total_params is not None:
        raise UserError(Problem("--measure", "needs a recipe to train, not --total-params"))
    if args.measure and args.measured:
        raise UserError(Problem("--measure", "give either --measure or --measured, not both"))
    if args.total_params is not None and args.overrides:
        raise UserError(Problem("--total-params", "give either a recipe (overrides) or --total-params, not both"))
    if args.total_params is None and args.largest_layer_params is not None:
        raise UserError(Problem("--largest-layer-params", "needs --total-params"))

    from dsrun.estimate.report import build_report, render
    from dsrun.estimate.verdict import detect_budget

    spec, model_info, sources = _cold_inputs(args) if args.total_params is not None else _recipe_inputs(args)
    model_cfg, ds_cfg = model_info.pop("config", None), model_info.pop("ds", None)
    spec = _with_process(spec, args, sources, model_cfg=model_cfg, ds_cfg=ds_cfg)
    report = build_report(spec, model_info, sources, detect_budget())
    stages = _pipeline_stages(spec, model_cfg, ds_cfg) if model_cfg is not None else None
    rows = None
    if args.measured or args.measure:
        from dsrun.estimate.measure import compare_peaks, load_measured_peaks

        if args.measure:
            import tempfile

            run_dir = Path(tempfile.mkdtemp(prefix="dsrun-measure-"))
            peaks = measure_run(list(args.overrides), list(args.recipes_dir), args.measure_steps,
                                args.measure_timeout, run_dir)
        else:
            peaks = load_measured_peaks(args.measured)
        recipe = report.recipe
        predicted: Any = {r: recipe.rank_peak if r == 0 else recipe.rank_peak_without_monitors for r in peaks}
        if stages is not None:  # rank r holds stage r // (ranks per stage): its own peak replaces the whole model's
            per_stage = max(1, len(peaks) // len(stages))
            predicted = {r: predicted[r] - recipe.peak_per_rank + stages[r // per_stage].peak for r in peaks}
        rows = compare_peaks(predicted, peaks)
    if args.json:
        import json

        data = json.loads(report.to_json())
        if stages is not None:
            data["pipeline_stages"] = [row.to_dict() for row in stages]
        if rows is not None:
            data["measured"] = [row.to_dict() for row in rows]
        print(json.dumps(data, indent=2))
        return 0
    from rich.console import Console

    console = Console()
    render(report, console)
    if stages is not None:
        from dsrun.estimate.pipeline import stages_table

        console.print(stages_table(stages, f"per pipeline stage (model.pipeline_stages={len(stages)}): the tables "
                                           "above hold the whole model on every rank; with the pipeline each "
                                           "rank holds one stage"))
    if rows is not None:
        from dsrun.estimate.measure import comparison_table

        console.print(comparison_table(rows, args.tolerance))
    return 0
