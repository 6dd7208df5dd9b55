"""The ZeRO-3 parameters a compiled graph reads (DeepSpeed's ``graph_param``): by the graph's input names."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DSGraphParam:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    param: torch.nn.Parameter

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass
class DSGraphParamManager:
    """``params``: input name -> :class:`DSGraphParam`; ``ds_ids``: input name -> ``ds_id``."""

    params: dict[str, DSGraphParam] = field(default_factory=dict)
    ds_ids: dict[str, int] = field(default_factory=dict)

    @property
    def param_names(self) -> list[str]:
        return list(self.params)

    def add(self, name: str, param: torch.nn.Parameter) -> None:
        self.params[name] = DSGraphParam(name, torch.Size(param.ds_shape), param.ds_tensor.dtype, param)
        self.ds_ids[name] = param.ds_id
