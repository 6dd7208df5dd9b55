"""The storage objects of DeepSpeed's ``save_torch_storage_object_list``: ``(untyped storage, dtype)`` pairs,
as torch's serializer holds them, seen as flat byte tensors."""
from __future__ import annotations

from typing import Tuple

import torch

StorageObject = Tuple[torch.UntypedStorage, torch.dtype]


def storage_nbytes(obj: StorageObject) -> int:
    return int(obj[0].nbytes())


def storage_bytes(obj: StorageObject) -> torch.Tensor:
    """The storage's bytes as a 1-D uint8 CPU tensor (a view where the storage is on the CPU)."""
    return torch.empty(0, dtype=torch.uint8, device=obj[0].device).set_(obj[0]).cpu()
