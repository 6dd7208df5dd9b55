"""The dominant Hessian eigenvalue of each layer block (the ``eigenvalue`` section), to pace MoQ.

For block ``i`` of the module list at ``layer_name`` (the first ``layer_num`` blocks; 0: all), power
iteration on ``H·v`` (Hessian-vector products by double backward of the loss of the last training
micro-batch) until the relative change is below ``tol`` or ``max_iter`` iterations; ``stability`` is added
to the norm of every iterate. The eigenvalues are then divided by the largest magnitude, so the most
sensitive block has 1.0 (a block whose eigenvalue came out 0 counts as 1.0). ``gas_boundary_resolution``:
computed on every N-th optimizer step only. ``verbose`` prints each block's value.

The last micro-batch comes from a forward pre-hook on the engine's module; the model's forward must
return the loss (a scalar tensor, or a tuple/object whose first element or ``.loss`` is one).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from dsrun import comm
from dsrun.utils.errors import Problem, UserError

if TYPE_CHECKING:
    from dsrun.config.misc import EigenvalueConfig


def _loss_of(output: object) -> torch.Tensor:
    """The scalar loss in whatever the model's forward returned (a tensor, a tuple, an object with ``loss``)."""
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    output = getattr(output, "loss", output)
    if not isinstance(output, torch.Tensor) or output.numel() != 1:
        raise UserError(Problem("eigenvalue.enabled", "the model's forward does not return a scalar loss, which "
                                "the Hessian eigenvalue needs", "return the loss from forward, or disable eigenvalue"))
    return output.reshape(())


class Eigenvalue:
    """Block Hessian eigenvalues of ``model`` as the ``eigenvalue`` config section says."""

    def __init__(self, model: nn.Module, config: EigenvalueConfig):
        self.config = config
        self.model = model
        try:
            blocks = model.get_submodule(config.layer_name)
        except AttributeError:
            raise UserError(Problem("eigenvalue.layer_name", f"{config.layer_name!r} is not a module of the model",
                                    "name the module list of its layers, e.g. 'transformer.h' for dsrun's GPT")) from None
        if not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
            raise UserError(Problem("eigenvalue.layer_name", f"{config.layer_name!r} is a {type(blocks).__name__}, "
                                    "not a list of layers"))
        count = config.layer_num or len(blocks)
        if count > len(blocks):
            raise UserError(Problem("eigenvalue.layer_num", f"got {count}; {config.layer_name!r} has {len(blocks)} layers"))
        self.blocks = [blocks[i] for i in range(count)]
        self.boundaries = 0
        self.last_batch: tuple[tuple, dict] | None = None
        self.values: dict[int, float] = {}
        self._hook = model.register_forward_pre_hook(self._capture, with_kwargs=True)

    def _capture(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if module.training and torch.is_grad_enabled():
            self.last_batch = (args, kwargs)

    def block_of_params(self, model: nn.Module) -> dict[int, int]:
        """``id(parameter) -> block index`` for the parameters inside the blocks."""
        return {id(p): i for i, block in enumerate(self.blocks) for p in block.parameters()}

    def due(self) -> bool:
        """Count an optimizer-step boundary; True on every ``gas_boundary_resolution``-th."""
        self.boundaries += 1
        return self.boundaries % self.config.gas_boundary_resolution == 0

    def compute(self) -> dict[int, float]:
        """Normalised eigenvalue per block index, from the last captured micro-batch."""
        if self.last_batch is None:
            return self.values
        rng = torch.random.get_rng_state()
        was_training = self.model.training
        args, kwargs = self.last_batch
        raw = []
        for block in self.blocks:
            params = [p for p in block.parameters() if p.requires_grad]
            with sdpa_kernel(SDPBackend.MATH):  # the fused attention kernels have no double backward
                loss = _loss_of(self.model(*args, **kwargs))
            grads = torch.autograd.grad(loss, params, create_graph=True)
            v = [torch.randn_like(p) for p in params]
            v = self._normalize(v)
            value, previous = 0.0, None
            for _ in range(self.config.max_iter):
                hv = torch.autograd.grad(grads, params, grad_outputs=v, retain_graph=True)
                hv = [torch.nan_to_num(h.detach().float(), nan=0.0, posinf=0.0, neginf=0.0) for h in hv]
                value = float(sum((h * x).sum() for h, x in zip(hv, v)))
                v = self._normalize(hv)
                if previous is not None and value != 0 and abs((value - previous) / value) < self.config.tol:
                    break
                previous = value
            raw.append(value)
        torch.random.set_rng_state(rng)
        self.model.train(was_training)
        if comm.is_initialized() and comm.get_world_size() > 1:  # every rank paces its weights alike
            device = next(self.model.parameters()).device  # NCCL reduces device tensors only
            tensor = torch.tensor(raw, dtype=torch.float64, device=device)
            comm.all_reduce(tensor)
            raw = (tensor / comm.get_world_size()).cpu().tolist()
        top = max((abs(x) for x in raw), default=0.0)
        self.values = {i: (abs(x) / top if x != 0 and top > 0 else 1.0) for i, x in enumerate(raw)}
        if self.config.verbose and (not comm.is_initialized() or comm.get_rank() == 0):
            print(f"[dsrun] eigenvalue: {', '.join(f'block {i}: {v:.4f}' for i, v in self.values.items())}", flush=True)
        return self.values

    def _normalize(self, vectors: list[torch.Tensor]) -> list[torch.Tensor]:
        norm = float(sum((x.float() ** 2).sum() for x in vectors)) ** 0.5 + self.config.stability
        return [torch.nan_to_num(x / norm) for x in vectors]
