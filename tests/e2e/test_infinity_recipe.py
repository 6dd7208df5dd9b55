"""The ``gpt_infinity`` recipe (ZeRO-3, optimizer states and parameters in NVMe files) end to end through the
CLI: it trains, its swap files live under the configured ``nvme_path`` and are gone when the run ends, and
``dsrun estimate-memory`` shows its NVMe row."""
from __future__ import annotations

import json
import re

from tests.helpers import free_port, run_cli

SHORT = ["train.max_steps=4", "train.eval_iters=1", "train.eval_interval=0", "data.max_bytes=300000"]


def test_gpt_infinity_recipe_trains_with_nvme_offload_and_cleans_up(tmp_path):
    nvme = tmp_path / "nvme"
    result = run_cli("train", "+recipe=gpt_infinity", *SHORT, f"launcher.master_port={free_port()}",
                     f"ds.zero_optimization.offload_param.nvme_path={nvme}",
                     f"ds.zero_optimization.offload_optimizer.nvme_path={nvme}", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (metrics_path,) = tmp_path.glob("outputs/*/*/metrics.json")
    metrics = json.loads(metrics_path.read_text())
    losses = metrics["train_losses"]
    assert metrics["steps"] == 4 and all(loss == loss and loss < 10 for loss in losses)
    assert losses[-1] < losses[0]
    ds = json.loads((metrics_path.parent / "ds_config.json").read_text())["zero_optimization"]
    assert ds["offload_param"]["device"] == ds["offload_optimizer"]["device"] == "nvme"
    swap_root = nvme / "dsrun_swap"
    assert swap_root.is_dir()  # the runs' stores were made here ...
    assert not any(path.is_file() for path in swap_root.rglob("*"))  # ... and removed at the end


def test_estimate_memory_of_the_infinity_recipe_puts_its_states_on_nvme():
    result = run_cli("estimate-memory", "+recipe=gpt_infinity", timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if re.match(r"^\s*3 \*\s+nvme/nvme", line)]
    assert len(rows) == 2, result.stdout  # the recipe's row, in both tables
    assert rows[0].split()[3:6] == ["0", "0", "0"] or rows[0].split()[4:6] == ["0", "0"], rows[0]
    assert rows[1].split()[-2] != "0"  # bytes in NVMe files
    assert "verdict for the recipe: fits" in result.stdout
