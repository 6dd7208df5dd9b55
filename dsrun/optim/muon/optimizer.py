"""``MuonWithAuxAdam``: Muon for the parameters of groups marked ``use_muon``, DeepSpeed's auxiliary Adam for
the rest (DeepSpeed's ``runtime/zero/muon/muon_optimizer.MuonWithAuxAdam``; its group defaults and checks).

Unbound (built outside an engine, or stepped on whole parameters) it orthogonalises each Muon parameter's
gradient itself (DeepSpeed's ``SingleDeviceMuonWithAuxAdam``). Bound to a ZeRO strategy (:mod:`.zero`, by the
Muon feature) the strategy's flat masters are not matrices: the binding computes the update on whole matrices
before the step and leaves it in the gradients, and the step only applies it, as DeepSpeed's ZeRO version does:
``p *= 1 - lr * weight_decay; p -= lr * update``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from dsrun.optim.rank_state import RangeRead, read_in_memory
from dsrun.utils.dynamo_free import DynamoFreeOptimizer

from .newton_schulz import (NS_METHODS, adam_update, muon_update, zeropower_via_gram_newtonschulz,
                            zeropower_via_newtonschulz5)

__all__ = ["MuonWithAuxAdam", "SingleDeviceMuonWithAuxAdam", "adam_update", "muon_param_groups", "muon_update",
           "set_optimizer_flags", "zeropower_via_gram_newtonschulz", "zeropower_via_newtonschulz5"]

MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0, "ns_method": "gram"}
ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0}


def _checked_group(group: dict[str, Any]) -> dict[str, Any]:
    if "use_muon" not in group:
        raise ValueError("MuonWithAuxAdam: every param group needs a use_muon flag (True: Muon, False: Adam)")
    for key, default in (MUON_DEFAULTS if group["use_muon"] else ADAM_DEFAULTS).items():
        group.setdefault(key, default)
    if group["use_muon"] and group["ns_method"] not in NS_METHODS:
        raise ValueError(f"ns_method must be one of {set(NS_METHODS)}, got {group['ns_method']}")
    return group


class MuonWithAuxAdam(DynamoFreeOptimizer):
    """Muon (momentum, Newton-Schulz orthogonalisation) for ``use_muon`` groups, Adam for the others.

    Muon groups' params are ordered by size, largest first (DeepSpeed's distributed order)."""

    def __init__(self, param_groups: list[dict[str, Any]]):
        groups = [_checked_group(dict(group)) for group in param_groups]
        for group in groups:
            group["params"] = list(group["params"])
            if group["use_muon"]:
                group["params"] = sorted(group["params"], key=lambda p: p.size(), reverse=True)
        super().__init__(groups, {})
        self.binding: Any = None  # dsrun.optim.muon.zero.ZeroMuon once bound to a strategy

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)  # DeepSpeed's: the momentum decays on a step without a gradient
                if group["use_muon"]:
                    self._muon(p, group)
                else:
                    self._adam(p, group)
        return loss

    def _muon(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        if self.binding is not None:  # the strategy left the orthogonalised update in the gradient
            update = p.grad
        else:
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p)
            update = muon_update(p.grad, state["momentum_buffer"], beta=group["momentum"],
                                 ns_method=group["ns_method"], is_expert_group=getattr(p, "is_expert_group", False))
        _apply(p, update, group)

    def _adam(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] = 0
        state["step"] = int(state["step"]) + 1
        update = adam_update(p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"], group["betas"],
                             group["eps"])
        _apply(p, update, group)

    # --- flat tiles: what ZeRO-Infinity's NVMe step updates (dsrun/offload/nvme.py, as a CPU optimizer's) ------
    STATE_KEYS = ("exp_avg", "exp_avg_sq")  # every state a tile may have (the auxiliary Adam's)

    def tile_state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The states a flat tile of ``group`` is stepped with: Adam's two moments, none for a Muon group (the
        binding left its update in the gradient and keeps the momentum itself)."""
        return () if group["use_muon"] else self.STATE_KEYS

    def _state_dtype(self) -> torch.dtype:
        return torch.float32

    @torch.no_grad()
    def update_tile(self, group: dict[str, Any], param: torch.Tensor, grad: torch.Tensor,
                    states: dict[str, torch.Tensor], step: int, low_precision: torch.Tensor | None = None) -> None:
        """One update of a flat fp32 tile of ``group`` (the same arithmetic as :meth:`step` on a parameter): a
        Muon tile applies the update the binding wrote into ``grad``; an Adam tile steps ``states`` at ``step``
        (already incremented). ``low_precision``: also receives the new values, rounded."""
        if group["use_muon"]:
            if self.binding is None:
                raise RuntimeError("MuonWithAuxAdam.update_tile: a Muon tile needs the update a ZeRO binding "
                                   "computes on whole matrices (dsrun.optim.muon.zero.ZeroMuon)")
            update = grad
        else:
            update = adam_update(grad, states["exp_avg"], states["exp_avg_sq"], step, group["betas"], group["eps"])
        _apply(param, update, group)
        if low_precision is not None:
            low_precision.copy_(param)

    # --- the momentum a binding keeps per rank (checkpoints: optimizer_rank_states_<r>.pt) ---------------
    def rank_state_dict(self) -> dict[str, Any] | None:
        return self.binding.rank_state_dict() if self.binding is not None else None

    def load_rank_state_dicts(self, states: list[dict[str, Any]], read: RangeRead = read_in_memory) -> None:
        if self.binding is not None:
            self.binding.load_rank_state_dicts(states, read)


def _apply(p: torch.Tensor, update: torch.Tensor, group: dict[str, Any]) -> None:
    """Decoupled weight decay, then the step: ``p *= 1 - lr * weight_decay; p -= lr * update``."""
    p.mul_(1 - group["lr"] * group["weight_decay"])
    p.add_(update.reshape(p.shape), alpha=-group["lr"])


SingleDeviceMuonWithAuxAdam = MuonWithAuxAdam  # DeepSpeed's non-distributed name: the same class, unbound

MUON_KEYS = ("lr", "momentum", "weight_decay", "muon_lr", "ns_method")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "adam_lr")


def muon_param_groups(params: Any, optimizer_params: dict[str, Any]) -> list[dict[str, Any]]:
    """DeepSpeed's engine's groups for ``optimizer.type: Muon``: the trainable parameters marked ``use_muon``
    (``name='muon-params'``: ``lr``, ``momentum``, ``weight_decay``, ``ns_method``; ``muon_lr`` overrides ``lr``)
    and the others (``name='adam-params'``: ``lr``, ``betas``, ``eps``, ``weight_decay``; ``adam_lr`` overrides
    ``lr``). Param-group dicts are flattened first, as DeepSpeed does, and MoE expert parameters (``allreduce``
    False) then move into a copy of their group per expert group name (``"moe": True``, ``"name"``: DeepSpeed's
    ``split_params_into_different_moe_groups_for_optimizer`` after the split)."""
    unknown = sorted(set(optimizer_params) - set(MUON_KEYS) - set(ADAM_KEYS))
    if unknown:  # DeepSpeed drops them silently
        raise TypeError(f"unexpected keyword argument(s) {', '.join(unknown)} (Muon takes "
                        f"{', '.join(sorted(set(MUON_KEYS + ADAM_KEYS)))})")
    flat: list[torch.nn.Parameter] = []
    for item in params:
        flat.extend(item["params"] if isinstance(item, dict) else [item])
    unmarked = [p for p in flat if not hasattr(p, "use_muon")]
    if unmarked:
        raise ValueError(f"Muon: {len(unmarked)} parameter(s) have no use_muon attribute; set param.use_muon = "
                         "True / False (dsrun.initialize marks a model's parameters by DeepSpeed's rule)")

    def chosen(keys: tuple[str, ...], override: str) -> dict[str, Any]:
        values = {k: optimizer_params[k] for k in keys if k in optimizer_params and k != override}
        if override in optimizer_params:
            values["lr"] = optimizer_params[override]
        return values

    groups = []
    muon = [p for p in flat if p.use_muon and p.requires_grad]
    adam = [p for p in flat if not p.use_muon and p.requires_grad]
    if muon:
        groups.append(dict(params=muon, use_muon=True, name="muon-params", **chosen(MUON_KEYS, "muon_lr")))
    if adam:
        groups.append(dict(params=adam, use_muon=False, name="adam-params", **chosen(ADAM_KEYS, "adam_lr")))
    return _experts_apart(groups)


def _experts_apart(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    shared, experts = [], []
    for group in groups:
        by_name: dict[str, list[torch.nn.Parameter]] = {}
        for p in group["params"]:
            if getattr(p, "allreduce", True) is False:
                by_name.setdefault(p.group_name, []).append(p)
        kept = [p for p in group["params"] if getattr(p, "allreduce", True) is not False]
        if kept:
            shared.append({**group, "params": kept})
        experts += [{**group, "params": params, "moe": True, "name": name} for name, params in by_name.items()]
    return shared + experts


def set_optimizer_flags(model: torch.nn.Module) -> None:
    """DeepSpeed's ``set_optimizer_flags``: ``use_muon`` on every parameter of ``model``: True for a parameter
    of 2 or more dimensions whose name holds neither ``embed`` nor ``lm_head`` (case-insensitive). dsrun also
    counts the weight of an ``nn.Embedding`` as an embedding whatever its name (GPT-2's ``wte``/``wpe``, which
    DeepSpeed's rule would hand to Muon; a tied output head shares that weight): see docs/muon.md."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    for name, p in model.named_parameters():
        hidden = p.ndim >= 2 and not any(word in name.lower() for word in ("embed", "lm_head"))
        p.use_muon = hidden and id(p) not in tables
