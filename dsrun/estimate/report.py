"""What ``dsrun estimate-memory`` shows: the DeepSpeed tables, dsrun's stage x offload table, a verdict.

:func:`build_report` gathers everything into one :class:`MemoryReport`; :func:`render` prints it with rich
(the DeepSpeed tables verbatim, so they stay byte-identical to DeepSpeed's) and :meth:`MemoryReport.to_json`
gives the same content for machines.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dsrun.estimate.deepspeed_compat import format_zero2_table, format_zero3_table
from dsrun.estimate.comm_volume import step_comm_volume
from dsrun.estimate.inputs import EstimateInputs
from dsrun.estimate.peak import Breakdown, OptionEstimate, estimate_peak_bytes_per_rank, estimate_zero_options
from dsrun.estimate.verdict import MemoryBudget, Verdict, judge

if TYPE_CHECKING:
    from rich.console import Console


def format_bytes(n: int | float) -> str:
    """Human-readable binary size: ``512.0 MiB``, ``1.23 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def compact_bytes(n: int | float) -> str:
    """Short binary size for table cells: ``15.93G``, ``95.4M``, ``12K``, ``0``."""
    value = float(n)
    if value == 0:
        return "0"
    for unit, scale in (("T", 2**40), ("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if abs(value) >= scale:
            digits = 2 if unit in ("T", "G") else (1 if unit == "M" else 0)
            return f"{value / scale:.{digits}f}{unit}"
    return f"{value:.0f}B"


@dataclass
class MemoryReport:
    """Everything one estimate shows. ``model`` describes the counted model (name, total, largest layer),
    ``sources`` says where each input came from, ``recipe`` is the estimate for the recipe's own settings."""

    inputs: EstimateInputs
    model: dict[str, Any]
    sources: dict[str, str]
    zero2_table: str
    zero3_table: str
    recipe: Breakdown
    options: list[OptionEstimate]
    budget: MemoryBudget
    verdict: Verdict
    option_verdicts: list[Verdict] = field(default_factory=list)

    def to_json(self) -> str:
        spec = self.inputs
        shape = spec.model_shape
        data = {
            "model": {**self.model, "total_params": spec.total_params, "trainable_params": spec.trainable,
                      "largest_layer_params": spec.largest_layer_params},
            "layout": {"nodes": spec.nodes, "ranks_per_node": spec.ranks_per_node, "world_size": spec.world_size,
                       **({"tensor_parallel_size": spec.tensor_parallel_size}
                          if spec.tensor_parallel_size > 1 else {})},
            "inputs": {
                "zero_stage": spec.zero_stage, "offload_optimizer": spec.offload_optimizer,
                "offload_param": spec.offload_param, "precision": spec.precision, "optimizer": spec.optimizer,
                "micro_batch_size": spec.micro_batch_size, "seq_len": spec.seq_len,
                "activation_checkpointing": spec.activation_checkpointing,
                "gpt_shape": None if shape is None else {
                    "n_layer": shape.n_layer, "n_embd": shape.n_embd, "n_head": shape.n_head,
                    "vocab_size": shape.vocab_size, "ffn_hidden": shape.ffn,
                    "flash_attention": shape.flash_attention, "dropout": shape.dropout},
            },
            "sources": self.sources,
            "comm_per_step": step_comm_volume(spec).to_dict(),
            "deepspeed": {"zero2": self.zero2_table, "zero3": self.zero3_table},
            "recipe": self.recipe.to_dict(),
            "options": [dict(row.to_dict(), verdict=verdict.level)
                        for row, verdict in zip(self.options, self.option_verdicts)],
            "budget": {"host_total": self.budget.host_total, "host_available": self.budget.host_available,
                       "device_total": self.budget.device_total, "device": self.budget.device_name},
            "verdict": {"level": self.verdict.level, "host_need": self.verdict.host_need,
                        "device_need": self.verdict.device_need, "reason": self.verdict.reason},
        }
        return json.dumps(data, indent=2)


def build_report(spec: EstimateInputs, model: dict[str, Any], sources: dict[str, str],
                 budget: MemoryBudget) -> MemoryReport:
    """Estimate ``spec`` and every stage x offload variant of it, and judge them against ``budget``."""
    recipe = estimate_peak_bytes_per_rank(spec)
    options = estimate_zero_options(spec)
    pick = "with_checkpointing" if spec.checkpoint_mode.enabled else "without_checkpointing"
    dp_per_node = max(1, spec.ranks_per_node // spec.tensor_parallel_size)
    return MemoryReport(
        inputs=spec, model=model, sources=sources,
        # DeepSpeed's formulas over the data-parallel ranks (AutoTP: one rank's share over world / T)
        zero2_table=format_zero2_table(spec.total_params, dp_per_node, spec.nodes),
        zero3_table=format_zero3_table(spec.total_params, spec.largest_layer_params, dp_per_node,
                                       spec.nodes),
        recipe=recipe, options=options, budget=budget, verdict=judge(recipe, budget),
        option_verdicts=[judge(getattr(row, pick), budget) for row in options])


_LEVEL_STYLE = {"fits": "green", "tight": "yellow", "too big": "red"}


def _summary_lines(report: MemoryReport) -> list[str]:
    spec, model = report.inputs, report.model
    shape = spec.model_shape
    lines = [
        f"model: {model.get('name', '?')}  total {spec.total_params:,} params "
        f"(trainable {spec.trainable:,}), largest layer {spec.largest_layer_params:,}"
        + (f" ({model['largest_layer_name']})" if model.get("largest_layer_name") else ""),
        *([f"MoE: {model['moe_total']:,} params over all experts of all ranks, {model['moe_active']:,} active per "
           "token; the counts here are one rank's (its own experts)"] if model.get("moe_total") else []),
        f"layout: {spec.nodes} node(s) x {spec.ranks_per_node} rank(s) = {spec.world_size} "
        + (f"ranks: {spec.data_parallel_size} data-parallel x {spec.tensor_parallel_size} tensor-parallel (AutoTP; the "
           f"counts are one rank's share of the split model, whole: {spec.built_params:,})"
           if spec.tensor_parallel_size > 1 else "data-parallel ranks"),
        f"recipe: ZeRO {spec.zero_stage}, offload optimizer={spec.offload_optimizer} param={spec.offload_param}, "
        f"{spec.precision}, optimizer {spec.optimizer}, micro batch {spec.micro_batch_size}, "
        f"sequence {spec.seq_len}"
        + (f" (1/{spec.sequence_parallel_size} per rank, sequence parallel)" if spec.sequence_parallel_size > 1 else "")
        + f", activation checkpointing {spec.activation_checkpointing}",
    ]
    comm = step_comm_volume(spec)
    if comm.gradient_op != "none":
        quant = ", ".join(name for name, on in (("qwZ INT8 gathers", spec.buffers.zero_quantized_weights),
                                                ("qgZ INT4 gradients", spec.buffers.zero_quantized_gradients),
                                                ("frozen weights INT8",
                                                 spec.buffers.zero_quantized_nontrainable_weights)) if on)
        replica = f", MiCS replica all-reduce {format_bytes(comm.replica_bytes)}" if comm.replica_bytes else ""
        lines.append(f"communication per optimizer step and rank: all-gather {format_bytes(comm.gather_bytes)}, "
                     f"gradients ({comm.gradient_op}) {format_bytes(comm.gradient_bytes)}{replica}, leaving the rank "
                     f"{format_bytes(comm.traffic_bytes)}" + (f" ({quant})" if quant else ""))
    if shape is not None:
        lines.append(f"GPT shape: {shape.n_layer} layers, hidden {shape.n_embd}, {shape.n_head} heads, "
                     f"vocab {shape.vocab_size}, {'fused' if shape.flash_attention else 'explicit'} attention")
    return lines


def render(report: MemoryReport, console: Console | None = None) -> None:
    """Print ``report`` with rich: summary, the two DeepSpeed tables (verbatim), our table, the verdict."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    for line in _summary_lines(report):
        console.print(line, markup=False, highlight=False)
    if report.sources:
        console.print("inputs from: " + ", ".join(f"{k}={v}" for k, v in report.sources.items()),
                      markup=False, highlight=False, style="dim")
    console.rule("DeepSpeed-compatible ZeRO-2 estimate (model states only)")
    console.print(report.zero2_table, end="", markup=False, highlight=False, soft_wrap=True)
    console.rule("DeepSpeed-compatible ZeRO-3 estimate (model states only)")
    console.print(report.zero3_table, end="", markup=False, highlight=False, soft_wrap=True)

    spec = report.inputs
    pick = "with_checkpointing" if spec.checkpoint_mode.enabled else "without_checkpointing"
    title = (f"dsrun estimate per rank: {spec.precision}, {spec.optimizer}, micro batch {spec.micro_batch_size}"
             f" x {spec.seq_len}; offload = optimizer/param; ckpt = activation checkpointing "
             f"({spec.activation_checkpointing if spec.checkpoint_mode.enabled else 'full'}); G = GiB, M = MiB")
    states = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    totals = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("ZeRO", "offload", "params", "grads", "optim", "buffers", "acts", "acts ckpt"):
        states.add_column(name, justify="left" if name in ("ZeRO", "offload") else "right")
    for name in ("ZeRO", "offload", "peak", "peak ckpt", "host RAM", "per host", "nvme", "verdict"):
        totals.add_column(name, justify="left" if name in ("ZeRO", "offload", "verdict") else "right")
    for row, verdict in zip(report.options, report.option_verdicts):
        plain, ckpt = row.without_checkpointing, row.with_checkpointing
        chosen = getattr(row, pick)
        is_recipe = (row.zero_stage, row.offload_optimizer, row.offload_param) == (
            spec.zero_stage, spec.offload_optimizer, spec.offload_param)
        option = (f"{row.zero_stage}{' *' if is_recipe else ''}", f"{row.offload_optimizer}/{row.offload_param}")
        style = "bold" if is_recipe else None
        states.add_row(*option, compact_bytes(plain.params), compact_bytes(plain.gradients),
                       compact_bytes(plain.optimizer_states), compact_bytes(chosen.buffers),
                       compact_bytes(plain.activations), compact_bytes(ckpt.activations), style=style)
        totals.add_row(*option, compact_bytes(plain.peak_per_rank), compact_bytes(ckpt.peak_per_rank),
                       compact_bytes(chosen.host_peak_per_rank), compact_bytes(verdict.host_need),
                       compact_bytes(chosen.nvme_per_rank), f"[{_LEVEL_STYLE[verdict.level]}]{verdict.level}[/]",
                       style=style)
    console.print(states)
    console.print(totals)
    on_cpu = report.budget.device_total is None
    console.print("* = the recipe's own setting. peak = device memory per rank; host RAM = per rank, at least "
                  "what building the model takes; per host = RAM one host needs"
                  + (" (ranks run on the CPU, so their peaks count)" if on_cpu else "")
                  + "; the verdict uses the recipe's checkpointing setting.", markup=False, highlight=False,
                  style="dim")
    console.print(breakdown_table(report.recipe, spec.activation_checkpointing))
    for note in report.recipe.notes:
        console.print(f"note: {note}", markup=False, highlight=False, style="yellow")
    v = report.verdict
    console.print(f"verdict for the recipe: [{_LEVEL_STYLE[v.level]}]{v.level}[/] ({v.reason}); "
                  f"peak per rank {format_bytes(report.recipe.rank_peak)}", highlight=False)


def breakdown_rows(b: Breakdown, checkpointing: str = "none") -> list[tuple[str, int, str]]:
    """The recipe's estimate term by term: (term, bytes per rank, where it lives / when it counts)."""
    where = "RAM (ranks on the CPU)" if b.ranks_on_cpu else "device"
    rows = [
        ("parameters (working + fp32 master)", b.params, where),
        ("gradients", b.gradients, where),
        ("optimizer states", b.optimizer_states, where),
        (f"activations (checkpointing: {checkpointing})", b.activations,
         f"{where}, forward/backward"),
        ("communication buffers at the peak phase", b.buffers, f"{where}, {b.peak_phase}"),
        ("  of which collective temporaries (gloo)", b.collective_temporaries, f"{where}, {b.peak_phase}"),
        ("tied embedding gradients (head's, embedding's, sum)", b.tied_gradients,
         f"{where}, tied embedding backward"),
        ("optimizer step workspace", b.optimizer_workspace, f"{where}, optimizer step"),
        ("device runtime overhead (given)", b.runtime, where),
        ("device peak", b.peak_per_rank, f"{where}, at {b.peak_phase}"),
        ("rank runtime (measured idle rank)", b.rank_runtime, "host RAM"),
        ("monitors (rank 0's, measured)", b.monitors, "host RAM, rank 0"),
        ("data pipeline (mapped tokens)", b.data_pipeline, "host RAM"),
        ("offloaded states and swap buffers", b.offloaded, "host RAM"),
        ("building the model (runtime + fp32 model)", b.init_per_rank, "host RAM, before training"),
        ("NVMe", b.nvme_per_rank, "files"),
        ("rank peak" + (" (device peak + host RAM)" if b.ranks_on_cpu else " (device)"), b.rank_peak,
         "what --measure compares"),
    ]
    return rows


def breakdown_table(b: Breakdown, checkpointing: str = "none") -> Any:
    """A rich table of :func:`breakdown_rows` for the recipe's own setting."""
    from rich import box
    from rich.table import Table

    table = Table(title="the recipe's estimate, term by term (per rank; formulas: docs/estimate.md)",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("term", "bytes", "where / when"):
        table.add_column(name, justify="right" if name == "bytes" else "left")
    for term, value, where in breakdown_rows(b, checkpointing):
        table.add_row(term, format_bytes(value), where, style="bold" if term.startswith("rank peak") else None)
    return table
