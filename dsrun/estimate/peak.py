"""The per-rank peak: model states + activations + buffers, phase by phase, and the process around them.

A rank's device memory at any moment is its resident model states plus what the current phase adds:

* forward/backward: the activations of one micro batch, stage 2's bucket pool, at ZeRO-3 the gathered
  parameters (and the reduction buckets when the model needs more than one), and gloo's temporaries of the
  collectives launched meanwhile;
* end of backward: the activations are gone; the pool, ZeRO-3's gathered parameters and reduction buckets
  and the last buckets' collective temporaries;
* the tied embedding's backward (GPTs whose head shares the token embedding): autograd holds the head's weight
  gradient from the first backward op to the last, the embedding's own gradient, and their sum, three
  ``vocab x n_embd`` tensors in the working precision at once (measured: GPT-2 small, 3 x 73.6 MiB in bf16 at
  every stage), with stage 2's pool and ZeRO-3's gathered parameters;
* optimizer step: the pool and the optimizer's workspace;
* parameter all-gather (stages 1-2): the pool and gloo's copy of the gathered model.

``peak = resident + max(phase extras) + runtime_overhead_bytes``. Host RAM per rank is the rank process
itself (``rank_runtime_bytes``, measured; ``data_bytes``), the offloaded states and the NVMe swap buffers.
Building the model needs the process and the model in fp32 first (``init_per_rank``). When ranks run on
the CPU, device memory is the process's RAM, so the whole rank peaks at
``rank_peak = max(peak + host, init)``: what ``--measure`` compares with the rank's measured peak RSS.
This module is pure arithmetic on :class:`EstimateInputs`, so the autotuner can call it for every candidate.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from dsrun.estimate.activations import ActivationBytes, gpt_activation_bytes
from dsrun.estimate.buffers import buffer_bytes, working_bytes
from dsrun.estimate.inputs import EstimateInputs
from dsrun.estimate.model_states import init_bytes_per_rank, model_state_bytes


@dataclass(frozen=True)
class Breakdown:
    """Estimated memory of one rank, in bytes.

    Device (the accelerator, or the CPU when ranks run on it): ``params`` (working + fp32 master copy),
    ``gradients`` (working + fp32 copy), ``optimizer_states``, ``activations`` (one micro batch; 0 when
    the model shape is unknown, see ``notes``), ``buffers`` (gradient reduction buckets and ZeRO-3
    gathered parameters at the peak phase), ``tied_gradients`` (a tied embedding's three gradients at the end of
    backward), ``optimizer_workspace`` (the step's temporaries),
    ``collective_temporaries`` (gloo's copies of the collectives in that phase; part of ``buffers``),
    ``peak_phase`` ("forward/backward", "end of backward", "tied embedding backward", "optimizer step" or
    "parameter all-gather"),
    ``peak_per_rank`` (the total at that phase).
    Host: ``rank_runtime`` (the idle rank process, measured), ``data_pipeline`` (its data's resident
    share), ``monitors`` (rank 0's monitors: the figures are rank 0's, the largest; ``rank_peak_without_monitors``
    is every other rank's), ``offloaded`` (offloaded states and NVMe swap buffers), ``host_per_rank`` (the four
    together, while training), ``init_per_rank`` (host RAM while building the model), ``host_peak_per_rank`` (the
    larger of the two). ``nvme_per_rank``: bytes offloaded to NVMe. ``rank_peak``: what one rank's
    process peaks at when ranks run on the CPU (``max(peak + host, init)``), else ``peak_per_rank``.
    ``ranks_per_node`` turns these into per-host figures.
    """

    params: int
    gradients: int
    optimizer_states: int
    activations: int
    buffers: int
    optimizer_workspace: int
    peak_phase: str
    runtime: int
    peak_per_rank: int
    host_per_rank: int
    init_per_rank: int
    nvme_per_rank: int
    ranks_per_node: int
    notes: tuple[str, ...] = field(default=())
    collective_temporaries: int = 0
    rank_runtime: int = 0
    data_pipeline: int = 0
    offloaded: int = 0
    ranks_on_cpu: bool = False
    tied_gradients: int = 0
    monitors: int = 0

    @property
    def model_states(self) -> int:
        return self.params + self.gradients + self.optimizer_states

    @property
    def host_peak_per_rank(self) -> int:
        return max(self.host_per_rank, self.init_per_rank)

    @property
    def rank_peak(self) -> int:
        """One rank's peak: on the CPU the whole process (device and host are the same RAM), else the
        device's."""
        if self.ranks_on_cpu:
            return max(self.peak_per_rank + self.host_per_rank, self.init_per_rank)
        return self.peak_per_rank

    @property
    def rank_peak_without_monitors(self) -> int:
        """The peak of a rank other than 0 (which opens no monitor)."""
        if self.ranks_on_cpu:
            return max(self.peak_per_rank + self.host_per_rank - self.monitors, self.init_per_rank - self.monitors)
        return self.peak_per_rank

    @property
    def peak_per_host(self) -> int:
        return self.peak_per_rank * self.ranks_per_node

    @property
    def host_per_host(self) -> int:
        return self.host_peak_per_rank * self.ranks_per_node

    @property
    def nvme_per_host(self) -> int:
        return self.nvme_per_rank * self.ranks_per_node

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["notes"] = list(self.notes)
        data.update(model_states=self.model_states, host_peak_per_rank=self.host_peak_per_rank,
                    rank_peak=self.rank_peak, rank_peak_without_monitors=self.rank_peak_without_monitors,
                    peak_per_host=self.peak_per_host,
                    host_per_host=self.host_per_host, nvme_per_host=self.nvme_per_host)
        return data


def activation_bytes(spec: EstimateInputs) -> ActivationBytes | None:
    """Activations of one micro batch for ``spec``; None when the model is not described by a GPT shape."""
    if spec.model_shape is None:
        return None
    return gpt_activation_bytes(spec.model_shape, spec.micro_batch_size, spec.seq_len, spec.precision,
                                spec.activation_checkpointing, spec.sequence_parallel_size, spec.tensor_parallel_size)


def tied_gradient_bytes(spec: EstimateInputs) -> int:
    """The tied embedding's gradients at the end of backward: the head's, the embedding's and their sum
    (0 when the head has its own weight or the shape is unknown)."""
    shape = spec.model_shape
    if shape is None or not shape.tied_embeddings:
        return 0
    return 3 * shape.vocab_size * shape.n_embd * working_bytes(spec)


def estimate_peak_bytes_per_rank(spec: EstimateInputs) -> Breakdown:
    """Estimate the peak memory of one data-parallel rank for ``spec`` (see the module docstring)."""
    states = model_state_bytes(spec)
    buffers = buffer_bytes(spec)
    acts = activation_bytes(spec)
    notes: list[str] = []
    act_total = 0
    if acts is None:
        notes.append("activations not estimated: the model has no GPT shape (n_layer, n_embd, n_head, vocab_size)")
    else:
        act_total = acts.total
    resident = states.device_total + spec.runtime_overhead_bytes
    step_extra = buffers.persistent + states.device_step_workspace
    tied, held = tied_gradient_bytes(spec), buffers.persistent + buffers.gathered_params
    # phase -> (bytes on top of the resident states, buffers among them, collective temporaries among them)
    phases = {
        "forward/backward": (act_total + buffers.backward, buffers.backward, buffers.collective_backward),
        "end of backward": (buffers.end_of_backward, buffers.end_of_backward, buffers.collective_end),
        "tied embedding backward": (tied + held, held, 0),
        "optimizer step": (step_extra, buffers.persistent, 0),
        "parameter all-gather": (buffers.publish, buffers.publish, buffers.collective_publish),
    }
    peak_phase = max(phases, key=lambda name: phases[name][0])  # ties keep the earlier phase
    peak_extra, peak_buffers, peak_collective = phases[peak_phase]
    process = spec.rank_runtime_bytes + spec.data_bytes + spec.monitor_bytes
    offloaded = states.host + states.host_buffers
    init = init_bytes_per_rank(spec) + process
    return Breakdown(
        params=states.device_params + states.device_master_params,
        gradients=states.device_gradients,
        optimizer_states=states.device_optimizer_states,
        activations=act_total,
        buffers=peak_buffers,
        optimizer_workspace=states.device_step_workspace,
        peak_phase=peak_phase,
        runtime=spec.runtime_overhead_bytes,
        peak_per_rank=resident + peak_extra,
        host_per_rank=offloaded + process,
        init_per_rank=init,
        nvme_per_rank=states.nvme,
        ranks_per_node=spec.ranks_per_node,
        notes=tuple(notes),
        collective_temporaries=peak_collective,
        rank_runtime=spec.rank_runtime_bytes,
        data_pipeline=spec.data_bytes,
        offloaded=offloaded,
        ranks_on_cpu=spec.device == "cpu",
        tied_gradients=tied,
        monitors=spec.monitor_bytes,
    )


# (stage, offload_optimizer, offload_param) combinations DeepSpeed supports: optimizer offload from stage 1,
# NVMe and parameter offload only at stage 3, parameters offloaded only with the optimizer.
ZERO_OPTIONS: tuple[tuple[int, str, str], ...] = (
    (0, "none", "none"),
    (1, "none", "none"), (1, "cpu", "none"),
    (2, "none", "none"), (2, "cpu", "none"),
    (3, "none", "none"), (3, "cpu", "none"), (3, "nvme", "none"),
    (3, "cpu", "cpu"), (3, "nvme", "cpu"), (3, "cpu", "nvme"), (3, "nvme", "nvme"),
)


@dataclass(frozen=True)
class OptionEstimate:
    """One row of the stage x offload table: the option and its estimate with and without checkpointing."""

    zero_stage: int
    offload_optimizer: str
    offload_param: str
    without_checkpointing: Breakdown
    with_checkpointing: Breakdown

    def to_dict(self) -> dict[str, Any]:
        return {"zero_stage": self.zero_stage, "offload_optimizer": self.offload_optimizer,
                "offload_param": self.offload_param,
                "without_checkpointing": self.without_checkpointing.to_dict(),
                "with_checkpointing": self.with_checkpointing.to_dict()}


def estimate_zero_options(spec: EstimateInputs) -> list[OptionEstimate]:
    """Estimate ``spec`` under every supported stage x offload option, with and without checkpointing ("with":
    the recipe's mode when it has one, else full)."""
    mode = spec.activation_checkpointing if spec.checkpoint_mode.enabled else "full"
    rows = []
    for stage, optim, param in ZERO_OPTIONS:
        variant = spec.with_(zero_stage=stage, offload_optimizer=optim, offload_param=param)
        rows.append(OptionEstimate(
            zero_stage=stage, offload_optimizer=optim, offload_param=param,
            without_checkpointing=estimate_peak_bytes_per_rank(variant.with_(activation_checkpointing="none")),
            with_checkpointing=estimate_peak_bytes_per_rank(variant.with_(activation_checkpointing=mode))))
    return rows
