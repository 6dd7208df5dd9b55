"""``data_types.keep_in_fp32_modules`` beside the other features, two gloo ranks, one launch for every case.

Each case (a name, its config overrides and the reference run) trains test_keep_in_fp32_modules.py's ``Net`` three
ways for ``STEPS`` steps:

* **mixed**: bf16 (fp16 for the loss-scaler cases) keeping ``["mid"]``: the kept weights hold fp32 (dtype, and
  digits bf16 cannot hold after the updates), the rest 16-bit, the losses finite and falling; under fp16 an
  ``inf`` put into the kept weight's gradient at the first step makes the loss scaler skip that step.
* **all**: bf16 keeping every module: the whole model is fp32 through the kept path (its own fp32 flat groups,
  sub-groups, fp32 reductions, the feature's handling of them) and must give the reference's parameters bit for
  bit, on each rank (stage 3: each rank's shards);
* **reference**: the fp32 model with the same feature (``fp32``), or where the feature leaves the kept
  parameters out (ZeRO++'s quantized weights and gradients gather and reduce them exactly) the same run without
  that feature.

The 1-bit optimizers also compare their mixed run at stage 1 with the same at stage 0, bit for bit (the kept
parameters are a master of their own, partitioned at stage 1).
"""
from __future__ import annotations

import math
import tempfile
from typing import Any

import pytest
import torch

from tests.helpers import run_ranks
from tests.integration.test_keep_in_fp32_modules import Net

STEPS = 4
ADAM = {"type": "Adam", "params": {"lr": 1e-2}}
ZENFLOW = {"topk_ratio": 0.5, "update_interval": 2, "full_warm_up_rounds": 0, "overlap_step": False}
NVME = "<nvme>"  # replaced by each rank's own temporary folder


def _onebit(name: str, **params: Any) -> dict[str, Any]:
    return {"type": name, "params": {"lr": 1e-3, **params}}


# name -> (zero_optimization, optimizer, other top-level keys, how the reference run differs: None = the fp32
# model with the same settings, else a zero_optimization to use instead of the case's, fp32 too)
CASES: dict[str, tuple[dict, dict, dict, dict | None]] = {
    "OneBitAdam stage 1": ({"stage": 1}, _onebit("OneBitAdam", freeze_step=2), {}, None),
    # eps 1e-4: after the variance freezes, a dead ReLU unit's zero variance beside its compressed (nonzero)
    # momentum would otherwise step by lr * scale / 1e-8 (the fp32 model diverges the same way)
    "ZeroOneAdam": ({"stage": 0}, _onebit("ZeroOneAdam", var_freeze_step=2, var_update_scaler=1,
                                          local_step_scaler=1000, local_step_clipper=1, eps=1e-4), {}, None),
    "OneBitLamb stage 1": ({"stage": 1}, _onebit("OneBitLamb", freeze_step=2, coeff_beta=0.5), {}, None),
    "Muon stage 3": ({"stage": 3}, {"type": "Muon", "params": {"lr": 1e-2}}, {}, None),
    "qwZ": ({"stage": 3, "zero_quantized_weights": True}, ADAM, {}, {"stage": 3}),
    "qgZ": ({"stage": 3, "zero_quantized_gradients": True}, ADAM, {}, {"stage": 3}),
    "hpZ": ({"stage": 3, "zero_hpz_partition_size": 2}, ADAM, {}, None),
    "super_offload": ({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": NVME,
                                                         "super_offload": True}}, ADAM, {"gradient_clipping": 0},
                      None),
    "ZenFlow stage 2": ({"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": ZENFLOW}, ADAM, {}, None),
    # an embedding's rows reduced sparsely: the kept bucket's other gradients keep their fp32 reduction
    "sparse_gradients": ({"stage": 0}, ADAM, {"sparse_gradients": True}, None),
    "fp16 stage 0": ({"stage": 0}, ADAM, {"fp16": {"enabled": True, "initial_scale_power": 8}}, None),
    "fp16 stage 3": ({"stage": 3}, ADAM, {"fp16": {"enabled": True, "initial_scale_power": 8}}, None),
}
STAGE_INVARIANT = ("OneBitAdam stage 1", "OneBitLamb stage 1")  # mixed at stage 1 == mixed at stage 0


class SparseNet(Net):
    """``Net`` reading token ids through an embedding whose gradient is row-sparse (``sparse=True``)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Embedding(32, 16, sparse=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.mid(self.first(ids)))).float().pow(2).mean()


def _config(case: str, mode: str, nvme: str, stage: int | None = None) -> dict[str, Any]:
    zero, optimizer, extra, reference = CASES[case]
    zero = dict(reference if mode == "reference" and reference is not None else zero)
    if stage is not None:
        zero["stage"] = stage
    if "nvme_path" in zero.get("offload_optimizer", {}):
        zero["offload_optimizer"] = {**zero["offload_optimizer"], "nvme_path": nvme}
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": optimizer, "zero_optimization": zero, **extra}
    if mode == "reference":
        config.pop("fp16", None)
    else:
        config.setdefault("bf16", {"enabled": True}) if "fp16" not in config else None
        config["data_types"] = {"keep_in_fp32_modules": ["mid"] if mode == "mixed" else ["first", "mid", "last"]}
    return config


def _held(param: torch.nn.Parameter) -> torch.Tensor:
    """What this rank holds of ``param``: its ZeRO-3 shard, or the parameter."""
    return getattr(param, "ds_tensor", param).detach()


def _train(case: str, mode: str, x: torch.Tensor, nvme: str, stage: int | None = None) -> dict[str, Any]:
    import dsrun

    sparse = "sparse" in case
    net = SparseNet() if sparse else Net()
    config = _config(case, mode, nvme, stage)
    engine = dsrun.initialize(model=net, config=config)[0]
    model_dtype = next(p for p in net.first.parameters()).dtype if mode == "mixed" else torch.float32
    if sparse:  # token ids: one per sample, from the sample's first feature
        x = (x[:, 0].abs() * 10).long() % 32
    overflow_once = mode == "mixed" and "fp16" in config
    if overflow_once:  # the loss scaler must see an inf that only a kept gradient holds
        handle = net.mid.proj.weight.register_hook(lambda g: g * math.inf)
    losses = []
    for _ in range(STEPS):
        loss = engine(x if sparse else x.to(model_dtype))
        engine.backward(loss)
        if overflow_once:
            handle.remove()
            overflow_once = False
        engine.step()
        losses.append(float(loss.detach()))
    weight = _held(net.mid.proj.weight)
    out = {"losses": losses, "skipped": engine.skipped_steps,
           "dtypes": {n: str(_held(p).dtype).replace("torch.", "") for n, p in net.named_parameters()},
           "fp32_digits": bool((weight != weight.bfloat16().float()).any()),
           "params": [_held(p).clone() for p in net.parameters()]}
    engine.destroy()
    return out


def train(rank: int, world: int) -> dict[str, dict[str, Any]]:
    from dsrun import comm

    comm.init_distributed(dist_backend="gloo")
    try:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)).bfloat16().float()
        out: dict[str, dict[str, Any]] = {}
        with tempfile.TemporaryDirectory() as nvme:
            for case in CASES:
                out[case] = {mode: _train(case, mode, x, nvme) for mode in ("mixed", "all", "reference")}
                if case in STAGE_INVARIANT:
                    out[case]["mixed stage 0"] = _train(case, "mixed", x, nvme, stage=0)
        return out
    finally:
        comm.destroy_process_group()


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(train, 2, timeout=400)


@pytest.mark.parametrize("case", list(CASES))
def test_kept_modules_train_fp32_beside_the_feature(ranks, case: str) -> None:
    low = "float16" if "fp16" in case else "bfloat16"
    for got in ranks:
        mixed, every, reference = got[case]["mixed"], got[case]["all"], got[case]["reference"]
        kept = {n for n, d in mixed["dtypes"].items() if d == "float32"}
        assert kept == {"mid.proj.weight", "mid.proj.bias"}, mixed["dtypes"]
        assert set(mixed["dtypes"].values()) == {"float32", low} and mixed["fp32_digits"]
        assert all(math.isfinite(v) for v in mixed["losses"]), mixed["losses"]
        assert mixed["skipped"] == (1 if "fp16" in case else 0)  # fp16: the kept inf was seen, the step skipped
        assert mixed["losses"][-1] < mixed["losses"][0], mixed["losses"]
        assert set(every["dtypes"].values()) == {"float32"}
        # bit for bit: the kept path is the fp32 model's arithmetic, on every rank's own share
        assert all(torch.equal(a, b) for a, b in zip(every["params"], reference["params"])), case
        # (the sparse model's whole-model island hands its loss back in bf16: no input was floating)
        rounded = [float(torch.tensor(v).bfloat16()) for v in reference["losses"]]
        assert every["losses"] == (rounded if "sparse" in case else reference["losses"])
        if case in STAGE_INVARIANT:
            assert all(torch.equal(a, b) for a, b in zip(mixed["params"], got[case]["mixed stage 0"]["params"]))
