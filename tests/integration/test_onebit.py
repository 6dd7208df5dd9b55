"""1-bit Adam, 0/1 Adam and 1-bit LAMB in the engine, on 2 CPU ranks (one launch runs every case):

* 1-bit Adam at stage 0 equals a plain-torch simulation of the algorithm (the same fp32 operations, the
  compressed all-reduce simulated for both ranks) through warm-up and compression, with gradient
  accumulation and per-rank clipping;
* ZeRO-1 gives what stage 0 gives, in fp32 and bf16, and every rank holds the same weights;
* once compression starts backward reduces nothing, and the comms logger's bytes meet the issue's bounds;
* exp_avg_mask keeps masked momentum exactly zero and masked weights still; frozen parameters stay as they are;
* resuming inside the compressed phase continues bitwise as the uninterrupted run;
* a checkpoint saved by 2 ranks inside the compressed phase, loaded by 3 ranks at ZeRO stage 0 and 1: every
  rank's worker error becomes the saved ranks' mean, the servers' errors are laid end to end and cut into the
  new chunks, and training goes on compressed.

The accuracy and traffic runs are ``Case`` records (tests/harness/runs.py) that record each step's row; the
masked, resumed and resharded runs are this module's rank entry points, all in one 2-rank launch.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from dsrun.checkpoint.safe_load import load_file
from dsrun.comm.compressed import CompressedLayout, merge_server_errors, split_server_error
from tests.harness.launch import Launch
from tests.harness.models import build_model, global_batch, slice_batch
from tests.harness.runs import WEIGHT_DECAY, Case, ds_config, train_steps, world_suite
from tests.unit.comm.test_compressed import simulate

WORLD = 2
LR, BETAS, EPS = 2e-3, (0.9, 0.999), 1e-8


def config(optimizer: str, params: dict[str, Any] | None = None, stage: int = 0, micro: int = 2, gas: int = 1,
           **extra: Any) -> dict[str, Any]:
    """``optimizer`` at ``LR`` (its ``params`` added) with DeepSpeed's default buckets and no clipping key
    (``extra`` sets top-level sections, ``gradient_clipping`` among them)."""
    return ds_config(stage, micro, gas, zero={"reduce_bucket_size": None, "allgather_bucket_size": None},
                     optimizer={"type": optimizer, "params": {"lr": LR, "weight_decay": WEIGHT_DECAY,
                                                              **(params or {})}},
                     **{"gradient_clipping": None, **extra})


def _accuracy_cases() -> list[Case]:
    """1-bit Adam against the simulation; 1-bit Adam and LAMB at stages 0 and 1 in fp32 and bf16; fp16."""
    cases = [Case("sim", "mlp", config("OneBitAdam", {"freeze_step": 3}, micro=1, gas=2, gradient_clipping=0.05),
                  steps=8, per_step=True)]
    for name, params in (("OneBitAdam", {"freeze_step": 3}), ("OneBitLamb", {"freeze_step": 10, "max_coeff": 0.5})):
        for precision in ("fp32", "bf16"):
            extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
            cases += [Case(f"stage{stage}/{name}/{precision}", "mlp", config(name, params, stage, **extra),
                           steps=params["freeze_step"] + 4, per_step=True) for stage in (0, 1)]
    fp16 = config("OneBitAdam", {"freeze_step": 3}, micro=1, gas=2, gradient_clipping=1.0,
                  fp16={"enabled": True, "initial_scale_power": 8})
    return cases + [Case("fp16", "mlp", fp16, steps=8, per_step=True)]


ACCURACY = _accuracy_cases()
TRAFFIC = [Case(key, "mlp", config(name, params), steps=20, per_step=True) for key, name, params in (
    ("adam", "Adam", {}), ("onebit", "OneBitAdam", {"freeze_step": 3}), ("lamb", "OneBitLamb", {"freeze_step": 10}),
    ("zero_one", "ZeroOneAdam", {"var_freeze_step": 3, "var_update_scaler": 1, "local_step_scaler": 2,
                                 "local_step_clipper": 8}))]


# --- the reference: 1-bit Adam at ZeRO stage 0 in plain torch, every rank simulated in one process ---------
def reference_onebit_adam(steps: int, world: int, micro: int, gas: int, freeze: int, clip: float) -> dict[str, Any]:
    """The same fp32 operations in the same order as the engine (ranks' gradients, warm-up average, per-rank
    clipping in the compressed phase, the compressed all-reduce of tests/unit/comm/test_compressed.py)."""
    from dsrun.comm.compressed import CompressedLayout

    model = build_model("mlp")
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    numel = flat.numel()
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    layout = CompressedLayout.of(numel, world)
    worker = [torch.zeros(numel) for _ in range(world)]
    server = [torch.zeros(layout.chunk) for _ in range(world)]
    beta1, beta2 = BETAS
    losses = []

    def clipped(g: torch.Tensor) -> torch.Tensor:
        if clip:
            norm = float(torch.dot(g, g).double()) ** 0.5
            if clip / (norm + 1e-6) < 1.0:
                return g.mul_(clip / (norm + 1e-6))
        return g

    for step in range(steps):
        t = step + 1
        batch = global_batch("mlp", step, micro * gas * world)
        local, totals = [], []
        for r in range(world):
            g, total = None, torch.zeros(1, dtype=torch.float64)
            for k in range(gas):
                offset = 0
                with torch.no_grad():
                    for p in params:
                        p.copy_(flat[offset:offset + p.numel()].view_as(p))
                        offset += p.numel()
                model.zero_grad()
                start = (k * world + r) * micro
                loss = model(slice_batch(batch, start, start + micro))
                (loss.float() / gas if gas > 1 else loss).backward()
                grads = torch.cat([p.grad.reshape(-1) for p in params])
                g = grads if g is None else g.add_(grads)
                total += loss.item()
            local.append(g)
            totals.append(total)
        losses.append((sum(totals[1:], totals[0])).item() / (world * gas))
        if t <= freeze:
            average = local[0].div(world)
            for g in local[1:]:
                average.add_(g.div(world))
            g = clipped(average)
            exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        else:
            inputs = [exp_avg.clone().mul_(beta1).add_(clipped(g), alpha=1 - beta1) for g in local]
            exp_avg, _, worker, server = simulate(inputs, worker, server, layout)
        bias1, bias2 = 1 - beta1 ** t, 1 - beta2 ** min(t, freeze)
        flat.mul_(1 - LR * WEIGHT_DECAY)
        denom = (exp_avg_sq.sqrt() / bias2 ** 0.5).add_(EPS)
        flat.addcdiv_(exp_avg, denom, value=-LR / bias1)
    return {"losses": losses, "params": flat.numpy()}


def mask_cases(rank: int, world: int) -> dict[str, Any]:
    """The first layer frozen; the last layer's first two rows masked (exp_avg_mask), no weight decay."""
    import dsrun

    def batch_from(first: int) -> Any:
        return lambda step, size: global_batch("mlp", first + step, size)

    out = {}
    for name, params in (("OneBitAdam", {"freeze_step": 3}), ("ZeroOneAdam", {"var_freeze_step": 4,
                         "var_update_scaler": 1, "local_step_scaler": 2}), ("OneBitLamb", {"freeze_step": 10})):
        for stage in ((0, 1) if name != "ZeroOneAdam" else (0,)):
            model = build_model("mlp")
            model.net[0].requires_grad_(False)
            last = model.net[4].weight
            mask = torch.ones_like(last)
            mask[:2] = 0.0
            groups = [{"params": [last], "exp_avg_mask": mask},
                      {"params": [p for n, p in model.named_parameters() if p.requires_grad and p is not last]}]
            frozen = model.net[0].weight.detach().clone()
            cfg = config(name, {**params, "weight_decay": 0.0}, stage)
            warmup = params.get("freeze_step", params.get("var_freeze_step"))
            engine, optimizer, _, _ = dsrun.initialize(model=model, config=cfg, model_parameters=groups)
            train_steps(engine, batch_from(0), warmup, rank, world)
            at_freeze = engine.module.net[4].weight.detach()[:2].clone()
            train_steps(engine, batch_from(warmup), 5, rank, world)
            master = optimizer.param_groups[0]["params"][0]
            own_mask = optimizer._masks[0]
            out[f"{name}/{stage}"] = {
                "masked_momentum": optimizer.state[master]["exp_avg"].masked_fill(own_mask != 0, 0).abs().max().item(),
                "masked_weights_moved": (engine.module.net[4].weight.detach()[:2] - at_freeze).abs().max().item(),
                "frozen_unchanged": torch.equal(engine.module.net[0].weight.detach(), frozen)}
    return out


def resume_cases(rank: int, world: int) -> dict[str, Any]:
    """Save at step 6 (inside the compressed phase), then a fresh engine loads it and trains on: its losses
    must equal the uninterrupted run's bitwise."""
    import dsrun
    from dsrun import comm

    out = {}
    cases = {"OneBitAdam/0": config("OneBitAdam", {"freeze_step": 3}, 0),
             "OneBitAdam/1": config("OneBitAdam", {"freeze_step": 3}, 1),
             "OneBitLamb/0": config("OneBitLamb", {"freeze_step": 10}, 0),
             "ZeroOneAdam/0": config("ZeroOneAdam", {"var_freeze_step": 3, "var_update_scaler": 1,
                                                     "local_step_scaler": 2}, 0)}
    save_at = {"OneBitLamb/0": 12}
    for key, cfg in cases.items():
        at = save_at.get(key, 6)
        folder = [tempfile.mkdtemp(prefix="dsrun-onebit-") if rank == 0 else None]
        comm.broadcast_object_list(folder, src=0)
        engine, _, _, _ = dsrun.initialize(model=build_model("mlp"), config=cfg)
        full = []
        for step in range(at + 4):
            if step == at:
                engine.save_checkpoint(folder[0])
            losses, _ = train_steps(engine, lambda s, size, step=step: global_batch("mlp", step, size), 1, rank,
                                    world)
            full += losses
        engine.destroy()
        resumed_engine, _, _, _ = dsrun.initialize(model=build_model("mlp"), config=cfg)
        resumed_engine.load_checkpoint(folder[0])
        resumed = []
        for step in range(at, at + 4):
            losses, _ = train_steps(resumed_engine, lambda s, size, step=step: global_batch("mlp", step, size), 1,
                                    rank, world)
            resumed += losses
        out[key] = {"full": full[at:], "resumed": resumed}
        resumed_engine.destroy()
    return out


def all_cases(rank: int, world: int, reshard_folder: str) -> dict[str, Any]:
    from dsrun import comm

    comm.init_distributed(verbose=False)
    out = {"accuracy": world_suite(rank, world, ACCURACY), "traffic": world_suite(rank, world, TRAFFIC),
           "mask": mask_cases(rank, world), "resume": resume_cases(rank, world)}
    save_for_resharding(rank, world, reshard_folder)
    comm.barrier()
    return out


def save_for_resharding(rank: int, world: int, folder: str) -> None:
    """2 ranks, stage 0: a checkpoint after 5 steps (two of them compressed)."""
    import dsrun

    engine, _, _, _ = dsrun.initialize(model=build_model("mlp"),
                                       config=config("OneBitAdam", {"freeze_step": 3}, 0))
    train_steps(engine, lambda step, size: global_batch("mlp", step, size), 5, rank, world)
    engine.save_checkpoint(folder)


def load_resharded(rank: int, world: int, folder: str) -> dict[int, dict[str, Any]]:
    """Another world size, at stages 0 and 1: the errors as loaded, then two more steps."""
    import dsrun

    out = {}
    for stage in (0, 1):
        engine, optimizer, _, _ = dsrun.initialize(model=build_model("mlp"),
                                                   config=config("OneBitAdam", {"freeze_step": 3}, stage))
        engine.load_checkpoint(folder)
        loaded = {"worker": optimizer.worker_errors[0].tolist(), "server": optimizer.server_errors[0].tolist(),
                  "reduces": engine.enable_backward_allreduce}
        losses, _ = train_steps(engine, lambda step, size: global_batch("mlp", 5 + step, size), 2, rank, world)
        out[stage] = {**loaded, "losses": losses}
        engine.destroy()
    from dsrun import comm
    from dsrun.checkpoint.ds_to_universal import ds_to_universal

    if rank == 0:  # the same checkpoint through its universal form, at stage 1
        tag = (Path(folder) / "latest").read_text()
        ds_to_universal(f"{folder}/{tag}", f"{folder}/{tag}_universal", verbose=False)
    comm.barrier()
    engine, optimizer, _, _ = dsrun.initialize(model=build_model("mlp"),
                                               config=config("OneBitAdam", {"freeze_step": 3}, 1))
    engine.load_checkpoint(folder, tag=f"{(Path(folder) / 'latest').read_text()}_universal")
    out["universal"] = {"worker": optimizer.worker_errors[0].tolist(), "server": optimizer.server_errors[0].tolist(),
                        "reduces": engine.enable_backward_allreduce, "losses": [0.0]}
    engine.destroy()
    return out


def launches(root: Path) -> dict:
    """Every case in one 2-rank launch; it saves a checkpoint into ``root`` for ``resharded``."""
    return {"cases": Launch(all_cases, WORLD, (str(root),), timeout=1200)}


def collect(runs) -> list[dict]:
    return runs["cases"]


@pytest.fixture(scope="module")
def reshard_folder(module_root: Path) -> Path:
    return module_root


def test_onebit_adam_equals_the_plain_torch_simulation(runs: list[dict]) -> None:
    expected = reference_onebit_adam(steps=8, world=WORLD, micro=1, gas=2, freeze=3, clip=0.05)
    got = runs[0]["accuracy"]["sim"]
    # the same fp32 operations in the same order: equal up to the last bit or two of each value
    torch.testing.assert_close(torch.tensor([r["loss"] for r in got["rows"]]), torch.tensor(expected["losses"]),
                               rtol=1e-6, atol=0)
    # flat_params gives float64 copies of the fp32 weights (exact); compare both as float64
    torch.testing.assert_close(torch.as_tensor(got["params"]).double(), torch.as_tensor(expected["params"]).double(),
                               rtol=1e-6, atol=1e-7)
    assert [r["reduced_next"] for r in got["rows"]] == [True, True] + [False] * 6


@pytest.mark.parametrize("name", ["OneBitAdam", "OneBitLamb"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero_stage1_gives_what_stage0_gives(runs: list[dict], name: str, precision: str) -> None:
    stage0 = runs[0]["accuracy"][f"stage0/{name}/{precision}"]
    stage1 = runs[0]["accuracy"][f"stage1/{name}/{precision}"]
    for rank in range(WORLD):  # every rank holds the same weights
        assert (runs[rank]["accuracy"][f"stage1/{name}/{precision}"]["params"] == stage1["params"]).all()
    # partitions update what the whole group would; only the order of a few sums differs (LAMB's norms)
    tolerance = 1e-6 if precision == "fp32" else 1e-2
    torch.testing.assert_close(torch.as_tensor(stage1["params"]), torch.as_tensor(stage0["params"]),
                               rtol=tolerance, atol=tolerance)


def test_no_backward_allreduce_once_compression_starts(runs: list[dict]) -> None:
    for key, result in runs[0]["accuracy"].items():
        rows = result["rows"]
        first = next(i for i, r in enumerate(rows) if not r["reduced_next"]) + 1
        for row in rows[first:]:
            big_reduces = [op for op, v in row["comm"].items()
                           if op in ("all_reduce", "reduce_scatter") and v["message_bytes"] / v["count"] > 1024]
            assert not big_reduces, (key, row["comm"])
            assert "all_to_all_single" in row["comm"], (key, row["comm"])
    assert all(all(r["loss"] == r["loss"] for r in res["rows"]) for res in runs[0]["accuracy"].values())


def _traffic(row: dict) -> float:
    return sum(v["traffic_bytes"] for v in row["comm"].values())


def test_bytes_in_the_compressed_phase_and_over_a_run(runs: list[dict]) -> None:
    traffic = runs[0]["traffic"]
    numel = traffic["adam"]["params"].size
    fp32_allreduce = 2 * (WORLD - 1) / WORLD * 4 * numel
    for key in ("onebit", "lamb"):
        rows = traffic[key]["rows"]
        freeze = 3 if key == "onebit" else 10
        for row in rows[freeze:]:
            assert _traffic(row) <= fp32_allreduce / 28, (key, row["comm"])
    adam_total = sum(_traffic(r) for r in traffic["adam"]["rows"])
    assert adam_total == 20 * fp32_allreduce  # the gradient all-reduce, nothing else
    assert sum(_traffic(r) for r in traffic["onebit"]["rows"]) <= adam_total / 4.5  # freeze at 15% of the steps
    # 0/1 Adam after var_freeze_step synchronises ever more rarely; 1-bit Adam exchanges at every step
    rounds_zero_one = sum("all_to_all_single" in r["comm"] for r in traffic["zero_one"]["rows"][3:])
    rounds_onebit = sum("all_to_all_single" in r["comm"] for r in traffic["onebit"]["rows"][3:])
    assert rounds_onebit == 17 and rounds_zero_one <= rounds_onebit / 2


def test_exp_avg_mask_and_frozen_parameters(runs: list[dict]) -> None:
    for rank in range(WORLD):
        for key, result in runs[rank]["mask"].items():
            assert result["masked_momentum"] == 0.0, key
            assert result["masked_weights_moved"] == 0.0, key
            assert result["frozen_unchanged"], key


@pytest.mark.parametrize("key", ["OneBitAdam/0", "OneBitAdam/1", "OneBitLamb/0", "ZeroOneAdam/0"])
def test_resume_inside_the_compressed_phase_is_exact(runs: list[dict], key: str) -> None:
    result = runs[0]["resume"][key]
    assert result["resumed"] == result["full"]


@pytest.fixture(scope="module")
def resharded(runs: list[dict], reshard_folder: Path):
    tag = (reshard_folder / "latest").read_text()
    saved = [load_file(reshard_folder / tag / f"optimizer_rank_states_{r}.pt") for r in range(WORLD)]
    return saved, Launch(load_resharded, 3, (str(reshard_folder),), timeout=600)()


@pytest.mark.parametrize("stage", [0, 1, "universal"])
def test_error_buffers_are_recut_for_three_ranks(resharded, stage) -> None:
    """Loaded by the resharding path at stages 0 and 1, and from the checkpoint's universal form at stage 1
    (the conversion carries each rank's error buffers)."""
    saved, loaded = resharded
    numel = saved[0]["worker_errors"][0].numel()
    assert all(torch.count_nonzero(s["worker_errors"][0]) for s in saved)  # compressed steps were taken
    worker = (saved[0]["worker_errors"][0] + saved[1]["worker_errors"][0]) / 2
    server = merge_server_errors([s["server_errors"][0] for s in saved], numel)
    # stage 1 serves the ZeRO partitions: the flat group padded to a multiple of 2 x 3
    layout = CompressedLayout.of(numel, 3, -(-numel // 6) * 2 if stage in (1, "universal") else None)
    for rank, per_rank in enumerate(loaded):
        result = per_rank[stage]
        torch.testing.assert_close(torch.tensor(result["worker"]), worker, rtol=0, atol=0)
        torch.testing.assert_close(torch.tensor(result["server"]), split_server_error(server, layout, rank),
                                   rtol=0, atol=0)
        assert result["reduces"] is False  # still in the compressed phase after the load
        assert all(loss == loss for loss in result["losses"])
