"""The PIL transforms of the example, with torchvision's sizes, crop offsets and resampling."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
from PIL import Image


class Compose:
    def __init__(self, transforms: Sequence[Callable]) -> None:
        self.transforms = list(transforms)

    def __call__(self, img: object) -> object:
        for transform in self.transforms:
            img = transform(img)
        return img


class Resize:
    """An int: the shorter edge becomes ``size``, the longer keeps the aspect ratio (rounded down)."""

    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = size

    def __call__(self, img: Image.Image) -> Image.Image:
        width, height = img.size
        if isinstance(self.size, int):
            short, long = (width, height) if width <= height else (height, width)
            new_short, new_long = self.size, int(self.size * long / short)
            new_w, new_h = (new_short, new_long) if width <= height else (new_long, new_short)
        else:
            new_h, new_w = self.size
        return img.resize((new_w, new_h), Image.BILINEAR)


class CenterCrop:
    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = (size, size) if isinstance(size, int) else tuple(size)

    def __call__(self, img: Image.Image) -> Image.Image:
        crop_h, crop_w = self.size
        width, height = img.size
        if crop_w > width or crop_h > height:
            raise ValueError(f"the stand-in CenterCrop does not pad: {crop_w}x{crop_h} from {width}x{height}")
        top, left = int(round((height - crop_h) / 2.0)), int(round((width - crop_w) / 2.0))
        return img.crop((left, top, left + crop_w, top + crop_h))


class ToTensor:
    """A PIL RGB image (H x W x C, 0-255) -> a float tensor C x H x W in [0, 1]."""

    def __call__(self, img: Image.Image) -> torch.Tensor:
        array = np.array(img, dtype=np.uint8, copy=True)
        return torch.from_numpy(array).permute(2, 0, 1).contiguous().float().div(255)


class Normalize:
    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean, self.std = list(mean), list(std)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        mean = torch.as_tensor(self.mean, dtype=tensor.dtype).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=tensor.dtype).view(-1, 1, 1)
        return (tensor - mean) / std
