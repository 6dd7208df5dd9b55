"""A 1-bit Adam checkpoint saved by 2 ranks inside the compressed phase, loaded by 3 ranks at ZeRO stage 0 and
1: every rank's worker error becomes the saved ranks' mean, the servers' errors are laid end to end and cut
into the new chunks, and training goes on compressed."""
from __future__ import annotations

import pytest
import torch

from dsrun.checkpoint.safe_load import load_file
from dsrun.comm.compressed import CompressedLayout, merge_server_errors, split_server_error
from tests.helpers import run_ranks
from tests.integration._onebit_workloads import load_resharded, save_for_resharding


@pytest.fixture(scope="module")
def resharded(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("onebit_reshard")
    run_ranks(save_for_resharding, 2, str(folder), timeout=300)
    tag = (folder / "latest").read_text()
    saved = [load_file(folder / tag / f"optimizer_rank_states_{r}.pt") for r in range(2)]
    return saved, run_ranks(load_resharded, 3, str(folder), timeout=400)


@pytest.mark.parametrize("stage", [0, 1])
def test_error_buffers_are_recut_for_three_ranks(resharded, stage: int) -> None:
    saved, loaded = resharded
    numel = saved[0]["worker_errors"][0].numel()
    assert all(torch.count_nonzero(s["worker_errors"][0]) for s in saved)  # compressed steps were taken
    results = [per_rank[stage] for per_rank in loaded]
    worker = (saved[0]["worker_errors"][0] + saved[1]["worker_errors"][0]) / 2
    server = merge_server_errors([s["server_errors"][0] for s in saved], numel)
    # stage 1 serves the ZeRO partitions: the flat group padded to a multiple of 2 x 3
    chunk = -(-numel // 6) * 2 if stage == 1 else None
    layout = CompressedLayout.of(numel, 3, chunk)
    for rank, result in enumerate(results):
        torch.testing.assert_close(torch.tensor(result["worker"]), worker, rtol=0, atol=0)
        torch.testing.assert_close(torch.tensor(result["server"]), split_server_error(server, layout, rank),
                                   rtol=0, atol=0)
        assert result["reduces"] is False  # still in the compressed phase after the load
        assert all(loss == loss for loss in result["losses"])
