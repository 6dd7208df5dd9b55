"""What a failed trial keeps as its error: each failing rank's own traceback from the run's rank logs (said
once when ranks fail alike), after the launcher's verdict; else the launch's stderr, e.g. a mistake dsrun
train found before launch."""
from dsrun.autotuning.trial import error_summary, failure_text

TRACEBACK = ["Traceback (most recent call last):", '  File "/x/dsrun/models/gpt.py", line 120, in forward',
             "    raise RuntimeError(...)", "RuntimeError: sequence length 128 exceeds model.block_size=64"]


def test_a_rank_crash_keeps_each_ranks_own_traceback(tmp_path):
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    for rank in (0, 1):
        (logs / f"rank{rank}.stderr.log").write_text("\n".join(f"[rank{rank}]:{line}" for line in
                                                               ["warming up", *TRACEBACK]) + "\n")
    stderr = tmp_path / "stderr.log"
    stderr.write_text("noise\ndsrun: job failed: rank 0 (local rank 0) on host localhost exited with exit code 1\n")
    text = failure_text(tmp_path / "run", stderr)
    assert text.splitlines()[0].startswith("dsrun: job failed: rank 0")
    assert text.count("Traceback (most recent call last)") == 1 and 'gpt.py", line 120' in text  # once
    assert error_summary(text) == TRACEBACK[-1]


def test_a_mistake_found_before_launch_is_the_launchs_own_line(tmp_path):
    stderr = tmp_path / "stderr.log"
    stderr.write_text("error: data.seq_len: 128 exceeds model.block_size=64 (lower data.seq_len or raise "
                      "model.block_size)\n")
    text = failure_text(tmp_path / "run", stderr)
    assert error_summary(text) == text == stderr.read_text().strip()
