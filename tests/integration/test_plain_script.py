"""A DeepSpeed-style script run with plain ``python`` (no launcher, no RANK/WORLD_SIZE) trains as one rank."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import REPO

SCRIPT = textwrap.dedent("""
    import argparse, torch, dsrun
    parser = dsrun.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    engine, optimizer, loader, _ = dsrun.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                    training_data=data)
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    print("rank", engine.global_rank, "world", engine.world_size, "steps", engine.global_steps)
""")


@pytest.mark.slow
def test_plain_python_script_runs_as_one_rank(tmp_path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "ds.json").write_text('{"train_batch_size": 4, "zero_optimization": {"stage": 2},'
                                      ' "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}')
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "train.py", "--deepspeed", "--deepspeed_config", "ds.json"], cwd=tmp_path,
                          env=env, text=True, capture_output=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "rank 0 world 1 steps 4" in done.stdout
