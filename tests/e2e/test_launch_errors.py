"""A config mistake of a user's own script under ``dsrun launch`` is one line and exit code 2: found before
launch where the config file and the number of ranks allow it (batch arithmetic no data-parallel share fits),
otherwise each rank reports it to the launcher (dsrun.launcher.protocol.install_user_error_hook), which says it
once (no config given: only the script's call to initialize can tell)."""
import json

import pytest

from tests.helpers import REPO, free_port, run_cli

EXAMPLE = str(REPO / "examples" / "train_with_dsrun.py")
BAD_BATCH = {"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
             "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}

CASES = [
    ("no --deepspeed_config (the ranks)", [], "error: initialize(config=...): no DeepSpeed config given"),
    ("batch arithmetic (before launch)", ["--deepspeed_config", "bad_batch.json"],
     "error: train_batch_size: train_batch_size 7 != train_micro_batch_size_per_gpu 2 * gradient_accumulation_steps "
     "1 * world size 2 = 4 (world size 2, from dsrun launch: 2 ranks)"),
]


@pytest.mark.parametrize("case,script_args,expected", CASES, ids=[c[0] for c in CASES])
def test_a_config_mistake_the_ranks_find_is_one_line_from_the_launcher(tmp_path, case, script_args, expected):
    (tmp_path / "bad_batch.json").write_text(json.dumps(BAD_BATCH))
    result = run_cli("launch", "--num_procs", "2", "--master_port", str(free_port()), EXAMPLE, "--deepspeed",
                     *script_args, cwd=tmp_path, timeout=180)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith(expected), lines
    assert "Traceback" not in result.stdout + result.stderr
