"""``deepspeed.linear.optimized_linear``: ``OptimizedLinear`` and its LoRA layer.

``LoRAOptimizedLinear`` computes ``x @ W.T + (lora_alpha / lora_r) * B(A(x))`` with the base weight ``W``
frozen and the adapters ``A`` (``lora_weight_1``, ``in -> r``, Kaiming-uniform) and ``B`` (``lora_weight_2``,
``r -> out``, zeros, so training starts from the base model) trainable. With ``base_weight_sharding = N`` (the
world size) each rank keeps ``1/N`` of ``W`` flattened (rank ``i`` the ``i``-th slice of the row-major
``(out, in)`` matrix) and all-gathers the whole before each forward, without autograd; the shards differ per rank
(each rank initialises its own, or a state-dict load cuts the rank's slice), so the engine does not broadcast
them (``ds_optim_param``).
"""
from __future__ import annotations

import math
from dataclasses import is_dataclass
import torch
import torch.nn.functional as F
from torch import nn

from dsrun import comm
from dsrun.accelerator import get_accelerator

from .config import LoRAConfig, QuantizationConfig
from .quantization import QuantizedLinear, QuantizedParameter


class OptimizedLinear(nn.Module):
    """``OptimizedLinear(input_dim, output_dim, bias=False, lora_config=None, quantization_config=None,
    device=None, dtype=torch.bfloat16, linear_cls=nn.Linear)`` builds, as DeepSpeed's does: a
    :class:`LoRAOptimizedLinear` with a LoRA config, a :class:`~dsrun.linear.quantization.QuantizedLinear` with a
    quantization config alone, else ``linear_cls`` (a plain linear)."""

    def __new__(cls, input_dim: int, output_dim: int, bias: bool = False, lora_config: LoRAConfig | None = None,
                quantization_config: QuantizationConfig | None = None, device: torch.device | str | None = None,
                dtype: torch.dtype = torch.bfloat16, linear_cls: type[nn.Module] = nn.Linear) -> nn.Module:
        if quantization_config is not None and not is_dataclass(quantization_config):
            raise ValueError(f"Expecting QuantizationConfig but received {type(quantization_config)}")
        if lora_config is not None and not is_dataclass(lora_config):
            raise ValueError(f"Expecting LoRAConfig but received {type(lora_config)}")
        if lora_config is not None:
            return LoRAOptimizedLinear(input_dim, output_dim, bias=bias, lora_config=lora_config,
                                       quantization_config=quantization_config, device=device, dtype=dtype,
                                       linear_cls=linear_cls)
        if quantization_config is not None:
            return QuantizedLinear(input_dim, output_dim, bias=bias, quantization_config=quantization_config,
                                   dtype=dtype)
        return linear_cls(input_dim, output_dim, bias=bias, dtype=dtype, device=device)


class LoRAOptimizedLinear(nn.Module):
    """A frozen (optionally sharded, optionally quantized) base weight plus trainable LoRA adapters; see the
    module docstring. ``bias`` must be False, as in DeepSpeed."""

    def __init__(self, input_dim: int, output_dim: int, bias: bool = False, lora_config: LoRAConfig | None = None,
                 quantization_config: QuantizationConfig | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.bfloat16, linear_cls: type[nn.Module] = nn.Linear):
        super().__init__()
        if lora_config is None:
            raise ValueError("LoRAOptimizedLinear needs a LoRAConfig (lora_config=...)")
        if bias:
            raise ValueError("LoRAOptimizedLinear(bias=True): DeepSpeed's LoRA linear has no bias; pass bias=False")
        if lora_config.offload or lora_config.offload_ratio:
            raise ValueError("LoRAConfig.offload/offload_ratio: dsrun keeps OptimizedLinear's base weights where "
                             "the model is (it does not move them between uses); leave offload=False, "
                             "offload_ratio=0")
        self.input_dim, self.output_dim, self.bias = input_dim, output_dim, bias
        self.lora_config, self.quantization_config = lora_config, quantization_config
        self.device = get_accelerator().current_device_name() if device is None else device
        self.linear_cls, self.dtype = linear_cls, dtype
        self.zero_shards = lora_config.base_weight_sharding
        self.sharded_weight_size = input_dim // self.zero_shards
        if self.zero_shards > 1:
            world = comm.get_world_size() if comm.is_initialized() else 1
            if self.zero_shards != world:
                raise ValueError(f"LoRAConfig.base_weight_sharding={self.zero_shards}: the base weight is sharded "
                                 f"over the whole world, which has {world} ranks here; set it to {world} (or 1)")
            if input_dim % self.zero_shards:
                raise ValueError(f"LoRAConfig.base_weight_sharding={self.zero_shards} does not divide the "
                                 f"layer's input size {input_dim}")
            weight = torch.empty(output_dim * self.sharded_weight_size, dtype=dtype)
        else:
            weight = torch.empty(output_dim, input_dim, dtype=dtype)
        nn.init.xavier_uniform_(weight.view(self.sharded_weight_size, output_dim))
        self.weight = (QuantizedParameter(weight, quantization_config=quantization_config)
                       if quantization_config is not None else nn.Parameter(weight, requires_grad=False))
        self.disabled = False
        self._initialized = False
        if not lora_config.delay_lora_init:
            self.init_lora()

    def disable(self) -> None:
        """Become a plain frozen linear (a state-dict load that does not name a LoRA target does this)."""
        self.disabled = True
        self.weight = nn.Parameter(torch.empty(self.output_dim, self.input_dim, dtype=self.dtype),
                                   requires_grad=False)

    def init_lora(self) -> None:
        """Freeze the base weight and build the adapters (A Kaiming-uniform, B zero, as PEFT does)."""
        if self.disabled:
            return
        if self.quantization_config is not None and not isinstance(self.weight, QuantizedParameter):
            # transformers' init may have replaced the parameter with a plain one
            self.weight = QuantizedParameter(self.weight.data, quantization_config=self.quantization_config)
        self._initialized = True
        self.weight.requires_grad = False
        self.weight.ds_optim_param = True  # per-rank shard: not broadcast at engine start
        self.lora_scaling_factor = self.lora_config.lora_alpha / self.lora_config.lora_r
        self.lora_weight_1 = self.linear_cls(self.input_dim, self.lora_config.lora_r, bias=False,
                                             device=self.device, dtype=self.dtype)
        self.lora_weight_2 = self.linear_cls(self.lora_config.lora_r, self.output_dim, bias=False,
                                             device=self.device, dtype=self.dtype)
        nn.init.kaiming_uniform_(self.lora_weight_1.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_weight_2.weight)
        self.lora_weight_1.weight.requires_grad = True
        self.lora_weight_2.weight.requires_grad = True

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: object) -> None:
        if not any(target in prefix for target in self.lora_config.target_mods):
            self.disable()  # not a LoRA target: a plain linear with the full weight
        elif self.zero_shards > 1:
            if not comm.is_initialized():
                raise RuntimeError("OptimizedLinear's base weight sharding needs torch.distributed initialised "
                                   "before the state dict is loaded (deepspeed.init_distributed())")
            local = self.output_dim * self.sharded_weight_size
            key = f"{prefix}weight"
            state_dict[key] = state_dict[key].flatten().narrow(0, comm.get_rank() * local, local)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def _local_weight(self) -> torch.Tensor:
        return self.weight.dequantized() if isinstance(self.weight, QuantizedParameter) else self.weight

    def full_weight(self) -> torch.Tensor:
        """The whole ``(out, in)`` base weight, all-gathered from every rank's shard."""
        local = self._local_weight()
        full = torch.empty(self.output_dim * self.input_dim, dtype=local.dtype, device=local.device)
        comm.all_gather_into_tensor(full, local.detach().reshape(-1))
        return full.view(self.output_dim, self.input_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.disabled:
            return F.linear(x, self.weight)
        if not self._initialized:
            raise RuntimeError("LoRAOptimizedLinear: init_lora was never called; call deepspeed.linear.init_lora"
                               "(model) once the model is built")
        if self.zero_shards > 1:
            with torch.no_grad():
                base = self.full_weight()
        else:
            base = self._local_weight()
        return F.linear(x, base) + self.lora_scaling_factor * self.lora_weight_2(self.lora_weight_1(x))
