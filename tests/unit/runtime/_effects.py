"""Helpers of the config effect tests (test_config_effects*.py): a tiny model, an engine from a config
with a few keys changed, fixed training steps, and a registry mapping each proved key to its case."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

import dsrun


def registry() -> tuple[dict[str, Callable[..., None]], Callable]:
    """(cases by key, a decorator ``@effect("key", ...)`` registering a case for those keys)."""
    cases: dict[str, Callable[..., None]] = {}

    def effect(*keys: str) -> Callable:
        def register(fn: Callable) -> Callable:
            for key in keys:
                assert key not in cases, key
                cases[key] = fn
            return fn
        return register
    return cases, effect


class CastLinear(torch.nn.Linear):
    """A linear layer that casts its input to its weight's dtype (inside its own forward, so ZeRO-3 reads the
    weight where it is gathered anyway: a read from the parent's forward would gather it as an external
    parameter of the parent and change the fetch order the stage-3 effect tests look at)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype))


class Net(torch.nn.Module):
    """Three linear layers; the first casts the input to the weights' dtype; the forward records what it got."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([CastLinear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)])
        self.input_dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.input_dtypes.append(x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == 2 else torch.tanh(layer(x))
        return x


def merged(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "steps_per_print": 1000}


def engine(extra: dict | None = None, **kwargs: Any) -> Any:
    return dsrun.initialize(model=kwargs.pop("model", None) or Net(), config=merged(BASE, extra or {}), **kwargs)[0]


def step(e: Any, n: int = 1, overflow_at: tuple[int, ...] = ()) -> None:
    """``n`` micro-steps on fixed data; an inf gradient on the micro-steps in ``overflow_at``."""
    weight = e.module.layers[0].weight
    for i in range(n):
        handle = weight.register_hook(lambda g: g * float("inf")) if i in overflow_at else None
        gen = torch.Generator().manual_seed(i)
        x, y = torch.randn(2, 4, generator=gen), torch.randn(2, 1, generator=gen)
        e.backward(F.mse_loss(e(x).float(), y))
        e.step()
        if handle is not None:
            handle.remove()


def first_weight(e: Any) -> torch.Tensor:
    return e.module.layers[0].weight.detach().float().clone()


def files(folder) -> int:
    return sum(1 for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0
