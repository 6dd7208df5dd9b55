"""``FlopsProfiler`` and ``get_model_profile``: per-module parameters, MACs, FLOPs and forward latency.

Usage (DeepSpeed's API)::

    prof = FlopsProfiler(model)
    prof.start_profile()
    model(inputs)                       # the profiled forward
    flops = prof.get_total_flops()
    prof.print_model_profile(profile_step=1)
    prof.end_profile()

    flops, macs, params = get_model_profile(model, args=[inputs], print_profile=False)

Counting (see :mod:`.counting`) is per call while the profile is active; each count is charged to the
innermost module whose forward is running, and a module's totals include its children. Backward is taken
as 2 x the forward flops. Numbers are per process ("per GPU"); a data-parallel world does not change them.
"""
from __future__ import annotations

import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence

import torch
from torch import nn

from .counting import ACTIVE, Patches
from .formatting import (duration_to_string, flops_to_string, macs_to_string, number_to_string,
                         params_to_string)

_LINE = "{:<70}  {:<8}"
_NOTE = (
    "Note: 1. A module can have torch.nn.module or torch.nn.functional to compute logits (e.g. "
    "CrossEntropyLoss). They are not counted as submodules, thus not to be printed out. However they make up "
    "the difference between a parent's MACs(or latency) and the sum of its submodules'.\n"
    "2. Number of floating-point operations is a theoretical estimation, thus FLOPS computed using that could "
    "be larger than the maximum system throughput.\n"
    "3. The fwd latency listed in the top module's profile is directly captured at the module forward "
    "function in PyTorch, thus it's less than the fwd latency shown above which is captured in DeepSpeed.\n")


@dataclass
class ModuleProfile:
    """One module's totals, children included. ``duration`` is seconds of forward."""

    params: int
    macs: int
    flops: int
    duration: float


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class ProfiledEngine(Protocol):
    """What the summary reads of the DeepSpeed engine (``mpu`` too, when it has one)."""

    world_size: int
    dp_world_size: int

    def train_micro_batch_size_per_gpu(self) -> int: ...


class FlopsProfiler:
    """Measures the forward pass of ``model``. ``ds_engine`` (optional) supplies the world/batch sizes and
    the backward and step latencies of the profiled step for the summary; ``recompute_fwd_factor`` counts
    that fraction of the forward again in backward (activation checkpointing)."""

    def __init__(self, model: nn.Module, ds_engine: ProfiledEngine | None = None, recompute_fwd_factor: float = 0.0):
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = float(recompute_fwd_factor)
        self.started = False
        self._patches = Patches()
        self._hooks: list[Any] = []
        self._stack: list[nn.Module] = []
        self._starts: list[float] = []
        self._self_flops: dict[int, int] = defaultdict(int)
        self._self_macs: dict[int, int] = defaultdict(int)
        self._duration: dict[int, float] = defaultdict(float)
        self._outside = [0, 0]  # flops, macs of counted calls made outside any module of the model
        # the engine turns this off: work its strategies do around the model's forward is not the model's
        self.count_outside_modules = True
        # latencies of the profiled step, filled in by the engine (seconds); None when unknown
        self.fwd_latency: float | None = None
        self.bwd_latency: float | None = None
        self.step_latency: float | None = None

    # --- DeepSpeed's lifecycle ----------------------------------------------------------------------------
    def start_profile(self, ignore_list: Sequence[type] | None = None) -> None:
        """Reset the counters, hook every module (except instances of the ``ignore_list`` classes, whose
        work is charged to their parent) and start counting torch calls."""
        if ACTIVE.sink is not None and ACTIVE.sink != self._add:
            raise RuntimeError("another FlopsProfiler is active in this thread; end it first")
        self.reset_profile()
        ignored = tuple(ignore_list or ())
        if not self._hooks:
            for module in self.model.modules():
                if ignored and isinstance(module, ignored):
                    continue
                self._hooks.append(module.register_forward_pre_hook(self._pre_hook))
                self._hooks.append(module.register_forward_hook(self._post_hook))
        self._patches.install()
        ACTIVE.sink = self._add
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting and remove the hooks; the numbers stay readable until :meth:`end_profile`."""
        if ACTIVE.sink == self._add:
            ACTIVE.sink = None
        self._patches.remove()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._stack.clear()
        self._starts.clear()

    def reset_profile(self) -> None:
        self._self_flops.clear()
        self._self_macs.clear()
        self._duration.clear()
        self._outside = [0, 0]

    def end_profile(self) -> None:
        """Stop and forget everything (call last)."""
        self.stop_profile()
        self.reset_profile()
        self.started = False

    # --- collection -------------------------------------------------------------------------------------
    def _add(self, flops: int, macs: int) -> None:
        if self._stack:
            key = id(self._stack[-1])
            self._self_flops[key] += flops
            self._self_macs[key] += macs
        elif self.count_outside_modules:
            self._outside[0] += flops
            self._outside[1] += macs

    def _pre_hook(self, module: nn.Module, inputs: tuple[object, ...]) -> None:
        if ACTIVE.sink is None:
            return
        self._stack.append(module)
        _sync()
        self._starts.append(time.perf_counter())

    def _post_hook(self, module: nn.Module, inputs: tuple[object, ...], output: object) -> None:
        if not self._stack or self._stack[-1] is not module:
            return
        _sync()
        self._duration[id(module)] += time.perf_counter() - self._starts.pop()
        self._stack.pop()

    # --- numbers ----------------------------------------------------------------------------------------
    def module_profile(self, module: nn.Module) -> ModuleProfile:
        """``module``'s parameters (trainable, its subtree) and its forward MACs, FLOPs and latency."""
        flops = macs = 0
        seen: set[int] = set()
        for sub in module.modules():
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            flops += self._self_flops.get(id(sub), 0)
            macs += self._self_macs.get(id(sub), 0)
        params = sum(p.numel() for p in module.parameters() if p.requires_grad)
        return ModuleProfile(params, macs, flops, self._duration.get(id(module), 0.0))

    def get_total_flops(self, as_string: bool = False) -> int | str:
        total = self.module_profile(self.model).flops + self._outside[0]
        return number_to_string(total) if as_string else total

    def get_total_macs(self, as_string: bool = False) -> int | str:
        total = self.module_profile(self.model).macs + self._outside[1]
        return macs_to_string(total) if as_string else total

    def get_total_duration(self, as_string: bool = False) -> float | str:
        total = self._duration.get(id(self.model), 0.0)
        return duration_to_string(total) if as_string else total

    def get_total_params(self, as_string: bool = False) -> int | str:
        total = self.module_profile(self.model).params
        return params_to_string(total) if as_string else total

    # --- the report -------------------------------------------------------------------------------------
    def _engine_sizes(self) -> dict[str, int] | None:
        engine = self.ds_engine
        if engine is None:
            return None
        mp = engine.mpu.get_model_parallel_world_size() if getattr(engine, "mpu", None) is not None else 1
        return {"world size": int(engine.world_size), "data parallel size": int(engine.dp_world_size),
                "model parallel size": int(mp), "batch size per GPU": int(engine.train_micro_batch_size_per_gpu())}

    def summary_lines(self, profile_step: int = 1) -> list[str]:
        sizes = self._engine_sizes()
        mp = sizes["model parallel size"] if sizes else 1
        params = self.get_total_params()
        flops = self.get_total_flops()
        macs = self.get_total_macs()
        fwd = self.fwd_latency if self.fwd_latency is not None else self.get_total_duration()
        lines = ["", "-------------------------- DeepSpeed Flops Profiler --------------------------",
                 f"Profile Summary at step {profile_step}:",
                 "Notations:",
                 "data parallel size (dp_size), model parallel size(mp_size),",
                 "number of parameters (params), number of multiply-accumulate operations(MACs),",
                 "number of floating-point operations (flops), floating-point operations per second (FLOPS),",
                 "fwd latency (forward propagation latency), bwd latency (backward propagation latency),",
                 "step (weights update latency), iter latency (sum of fwd, bwd and step latency)", ""]
        row = lambda key, value: lines.append(_LINE.format(key + ":", value))  # noqa: E731
        if sizes:
            for key, value in sizes.items():
                row(key, value)
        row("params per GPU", params_to_string(params))
        row("params of model = params per GPU * mp_size", params_to_string(params * mp))
        moe_counts = getattr(self.model, "moe_parameter_counts", None)
        if callable(moe_counts):  # Mixture of Experts: every expert of every rank vs what one token uses
            total, active = moe_counts()
            row("MoE params of model (all experts)", params_to_string(total))
            row("MoE params active per token (k experts per layer)", params_to_string(active))
        row("fwd MACs per GPU", macs_to_string(macs))
        row("fwd flops per GPU", number_to_string(flops))
        row("fwd flops of model = fwd flops per GPU * mp_size", number_to_string(flops * mp))
        row("fwd latency", duration_to_string(fwd))
        row("fwd FLOPS per GPU = fwd flops per GPU / fwd latency", flops_to_string(flops / fwd if fwd else 0.0))
        if self.bwd_latency is not None and self.step_latency is not None:
            r = self.recompute_fwd_factor
            bwd, step = self.bwd_latency, self.step_latency
            iteration = fwd + bwd + step
            row("bwd latency", duration_to_string(bwd))
            row(f"bwd FLOPS per GPU = {2 + r:g} * fwd flops per GPU / bwd latency",
                flops_to_string((2 + r) * flops / bwd if bwd else 0.0))
            row(f"fwd+bwd FLOPS per GPU = {3 + r:g} * fwd flops per GPU / (fwd+bwd latency)",
                flops_to_string((3 + r) * flops / (fwd + bwd) if fwd + bwd else 0.0))
            row("step latency", duration_to_string(step))
            row("iter latency", duration_to_string(iteration))
            row(f"FLOPS per GPU = {3 + r:g} * fwd flops per GPU / iter latency",
                flops_to_string((3 + r) * flops / iteration if iteration else 0.0))
            if sizes:
                row("samples/second", round(sizes["batch size per GPU"] * sizes["data parallel size"] / iteration, 2))
        return lines

    def _depth_table(self) -> dict[int, dict[str, list[float]]]:
        """depth -> class name -> [params, macs, latency], summed over the modules of that class."""
        table: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0, 0.0]))

        def walk(module: nn.Module, depth: int) -> None:
            prof = self.module_profile(module)
            entry = table[depth][type(module).__name__]
            entry[0] += prof.params
            entry[1] += prof.macs
            entry[2] += prof.duration
            for child in module.children():
                walk(child, depth + 1)

        walk(self.model, 0)
        return table

    def aggregated_lines(self, module_depth: int = -1, top_modules: int = 1) -> list[str]:
        table = self._depth_table()
        depths = len(table) if module_depth < 0 else min(module_depth, len(table))
        lines = ["", "----------------------------- Aggregated Profile per GPU -----------------------------",
                 f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
        for depth in range(depths):
            entries = table[depth]

            def top(index: int, fmt: Callable[[float], str]) -> dict[str, str]:
                ranked = sorted(entries.items(), key=lambda item: item[1][index], reverse=True)[:top_modules]
                return {name: fmt(values[index]) for name, values in ranked}

            lines += [f"depth {depth}:",
                      f"    params      - {top(0, params_to_string)}",
                      f"    MACs        - {top(1, macs_to_string)}",
                      f"    fwd latency - {top(2, duration_to_string)}"]
        return lines

    def _module_text(self, module: nn.Module, total: ModuleProfile) -> str:
        prof = self.module_profile(module)
        pct = lambda part, whole: 100.0 * part / whole if whole else 0.0  # noqa: E731
        parts = [params_to_string(prof.params), f"{pct(prof.params, total.params):.2f}% Params",
                 macs_to_string(prof.macs), f"{pct(prof.macs, total.macs):.2f}% MACs",
                 duration_to_string(prof.duration), f"{pct(prof.duration, total.duration):.2f}% latency",
                 flops_to_string(prof.flops / prof.duration if prof.duration else 0.0)]
        extra = module.extra_repr()
        return ", ".join(parts + ([extra] if extra else []))

    def _tree(self, module: nn.Module, total: ModuleProfile, depth: int, max_depth: int) -> str:
        # nn.Module.__repr__'s layout, with the profile in front of each module's own description
        body = self._module_text(module, total)
        children = list(module.named_children()) if max_depth < 0 or depth < max_depth else []
        if not children:
            return f"{type(module).__name__}({body})"
        lines = [f"{type(module).__name__}(", f"  {body}"]
        for name, child in children:
            text = self._tree(child, total, depth + 1, max_depth).replace("\n", "\n  ")
            lines.append(f"  ({name}): {text}")
        return "\n".join(lines) + "\n)"

    def detailed_lines(self, module_depth: int = -1) -> list[str]:
        total = self.module_profile(self.model)
        return ["", "------------------------------ Detailed Profile per GPU ------------------------------",
                "Each module profile is listed after its name in the following order: ",
                "params, percentage of total params, MACs, percentage of total MACs, fwd latency, percentage "
                "of total fwd latency, fwd FLOPS", "", _NOTE,
                self._tree(self.model, total, 0, module_depth)]

    def model_profile_text(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                           detailed: bool = True) -> str:
        lines = self.summary_lines(profile_step) + self.aggregated_lines(module_depth, top_modules)
        if detailed:
            lines += self.detailed_lines(module_depth)
        lines.append("------------------------------------------------------------------------------")
        return "\n".join(lines) + "\n"

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None) -> str:
        """Print the report (to ``output_file`` if given, else stdout) and return its text."""
        text = self.model_profile_text(profile_step, module_depth, top_modules, detailed)
        if output_file:
            with open(output_file, "w", encoding="utf-8") as handle:
                handle.write(text)
        else:
            sys.stdout.write(text)
            sys.stdout.flush()
        return text

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> str:
        text = "\n".join(self.aggregated_lines(module_depth, top_modules)) + "\n"
        sys.stdout.write(text)
        return text


def get_model_profile(model: nn.Module, input_shape: tuple | None = None, args: Iterable[Any] = [],
                      kwargs: dict[str, Any] = {}, print_profile: bool = True, detailed: bool = True,
                      module_depth: int = -1, top_modules: int = 1, warm_up: int = 1, as_string: bool = False,
                      output_file: str | None = None, ignore_modules: Sequence[type] | None = None,
                      mode: str = "forward") -> tuple[Any, Any, Any]:
    """Profile one forward of ``model``; returns ``(flops, macs, params)`` (strings with ``as_string``).

    With ``input_shape`` the model gets one tensor of that shape (zeros, in the model's dtype and device);
    otherwise it is called as ``model(*args, **kwargs)``. ``warm_up`` forwards run first, unprofiled.
    ``mode="generate"`` profiles ``model.generate(*args, **kwargs)`` instead.
    """
    args, kwargs = list(args or []), dict(kwargs or {})
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or len(input_shape) < 1:
            raise ValueError(f"input_shape must be a non-empty tuple, got {input_shape!r}")
        first = next(model.parameters(), None)
        dtype = first.dtype if first is not None else torch.float32
        device = first.device if first is not None else torch.device("cpu")
        args = [torch.zeros(input_shape, dtype=dtype, device=device), *args]
    elif not args and not kwargs:
        raise ValueError("give input_shape, or the model's inputs as args/kwargs")
    if mode not in ("forward", "generate"):
        raise ValueError(f"mode must be 'forward' or 'generate', got {mode!r}")
    call = model.generate if mode == "generate" else model
    with torch.no_grad():
        for _ in range(max(0, warm_up)):
            call(*args, **kwargs)
        prof = FlopsProfiler(model)
        prof.start_profile(ignore_list=ignore_modules)
        try:
            call(*args, **kwargs)
        finally:
            prof.stop_profile()
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    if print_profile:
        prof.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                 detailed=detailed, output_file=output_file)
    prof.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
