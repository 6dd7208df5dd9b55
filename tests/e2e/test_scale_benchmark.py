"""``benchmarks/scale.py``'s small path: one ZeRO-Infinity attempt in a watched subprocess, recorded as JSON,
with its swap files removed afterwards (the full benchmark is not run in CI)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO


@pytest.mark.slow
def test_scale_benchmark_runs_one_infinity_attempt_and_cleans_up(tmp_path):
    results = tmp_path / "results.json"
    nvme = tmp_path / "nvme"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "scale.py"), "--modes", "infinity", "--sizes",
                           "gpt-nano", "--nvme-path", str(nvme), "--json", str(results), "--timeout", "240"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (attempt,) = json.loads(results.read_text())
    assert attempt["mode"] == "infinity" and attempt["status"] == "ok", attempt
    losses = attempt["losses"]
    assert len(losses) == 3 and losses[2] < losses[1] < losses[0]
    assert attempt["peak_rss"] > 0 and attempt["step_s"] > 0
    assert not any(path.is_file() for path in nvme.rglob("*.swp"))  # swap files gone
    assert "| ZeRO-Infinity (NVMe) | gpt-nano |" in done.stdout
