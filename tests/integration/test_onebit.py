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
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsrun.checkpoint.safe_load import load_file
from dsrun.comm.compressed import CompressedLayout, merge_server_errors, split_server_error
from tests.harness.launch import Launch
from tests.integration._onebit_workloads import all_cases, load_resharded, reference_onebit_adam

WORLD = 2


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
