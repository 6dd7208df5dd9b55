"""`dsrun estimate-memory +recipe=gpt_offload`: the recipe's own row is ZeRO-2 with the optimizer on the CPU,
and it holds no optimizer state or fp32 gradient on the device."""
from __future__ import annotations

import re

from tests.helpers import run_cli


def test_estimate_memory_of_the_offload_recipe_reflects_the_offload():
    result = run_cli("estimate-memory", "+recipe=gpt_offload", timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if re.match(r"^\s*2 \*\s+cpu/none", line)]
    assert len(rows) == 2, result.stdout  # the recipe's row, in both tables
    params, grads, optim = rows[0].split()[3:6]
    assert grads == "0" and optim == "0", rows[0]
    assert "host RAM" in result.stdout and "verdict for the recipe: fits" in result.stdout
