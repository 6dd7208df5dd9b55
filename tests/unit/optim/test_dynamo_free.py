"""dsrun's torch optimizers (``dsrun.utils.dynamo_free.DynamoFreeOptimizer``) leave ``torch._dynamo`` unimported in a
process that never compiles, and behave as torch's under dynamo once it is imported."""
from __future__ import annotations

import os
import subprocess
import sys

from dsrun.optim.base import PerParameterOptimizer
from tests.helpers import REPO

# A fresh process: dsrun's CPU Adam (CPUOptimizer) and Lamb (PerParameterOptimizer) through every method torch
# wraps in _disable_dynamo, then torch's own SGD, whose __init__ imports torch._dynamo (the check can see it).
_RANK_LIKE = """
import sys, torch
from dsrun.optim.registry import build_optimizer
model = torch.nn.Linear(4, 2)
for kind in ("AdamW", "Lamb"):
    opt = build_optimizer(kind, list(model.parameters()), {"lr": 0.1})
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    opt.load_state_dict(opt.state_dict())
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
print("dsrun", "torch._dynamo" in sys.modules)
torch.optim.SGD(model.parameters(), lr=0.1)
print("torch", "torch._dynamo" in sys.modules)
"""


def test_dsrun_optimizers_do_not_import_dynamo() -> None:
    out = subprocess.run([sys.executable, "-c", _RANK_LIKE], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})  # the session's op cache: no build
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-3:-1] == ["dsrun False", "torch True"], out.stdout + out.stderr[-2000:]


def test_under_dynamo_the_methods_stay_out_of_the_graph_as_torchs_do() -> None:
    import torch
    import torch._dynamo

    class TorchBase(torch.optim.Optimizer):
        pass

    class DsrunBase(PerParameterOptimizer):
        pass

    counts = {}
    for cls in (TorchBase, DsrunBase):
        p = torch.nn.Parameter(torch.ones(3))
        p.grad = torch.ones(3)
        opt = cls([p], {})

        def fn(x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            opt.zero_grad()  # dynamo-disabled in torch: a graph break, run eagerly
            return y + 1

        explained = torch._dynamo.explain(fn)(torch.ones(2))
        counts[cls.__name__] = (explained.graph_count, explained.graph_break_count)
        assert p.grad is None  # it ran
    assert counts["DsrunBase"] == counts["TorchBase"] == (2, 1), counts
