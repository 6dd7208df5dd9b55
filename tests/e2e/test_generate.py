"""`dsrun generate` end to end on the default recipe's run directory: text from the trained model on one rank
and split over two (greedy: the same text), tokens/s reported, and a missing or incompatible checkpoint as
one error line with exit code 2."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import first_output_probe, free_port, run_cli

BUDGET = ["train.max_steps=60", "train.save_interval=60", "train.eval_interval=0", "train.eval_iters=1",
          "data.max_bytes=1000000"]
STATS = re.compile(r"^\[dsrun\] (\d+) new tokens in [\d.]+s: [\d,.]+ tokens/s \(prompt: (\d+) token\(s\); "
                   r"TP=(\d), fused KV-cache path, fp32; training checkpoint .*checkpoints \(tag global_step60\)\)$")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """The default recipe (2 ranks, ZeRO-2, checkpoints) with a shorter budget."""
    cwd = tmp_path_factory.mktemp("generate")
    result = run_cli("train", *BUDGET, f"launcher.master_port={free_port()}", cwd=cwd, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run,) = cwd.glob("outputs/*/*")
    return run


def generate(run_dir: Path, *extra: str):
    return run_cli("generate", str(run_dir), "--prompt", "def ", "--max-new-tokens", "40", "--temperature", "0",
                   *extra, timeout=300)


@pytest.mark.slow
def test_generate_prints_text_from_the_trained_model_on_one_rank_and_on_two(run_dir):
    texts = {}
    for tp, extra in ((1, ()), (2, ("launcher.num_procs=2", f"launcher.master_port={free_port()}"))):
        result = generate(run_dir, *extra)
        assert result.returncode == 0, result.stderr[-3000:]
        stats = STATS.match(result.stderr.strip().splitlines()[-1])
        assert stats, result.stderr
        stages = [line for line in result.stderr.splitlines() if line.startswith("[dsrun] ")][:2]
        assert stages[0].startswith("[dsrun] checking ") and stages[1].startswith(
            "[dsrun] loading the model" if tp == 1 else "[dsrun] starting 2 ranks (tensor parallel)"), stages
        assert (int(stats.group(1)), int(stats.group(2)), int(stats.group(3))) == (40, 4, tp)
        texts[tp] = result.stdout.rstrip("\n")
    assert texts[1] == texts[2]  # greedy: the split model picks the same tokens
    completion = texts[1][len("def "):]
    assert texts[1].startswith("def ") and len(completion.encode()) >= 30  # bytes; decoding may merge some
    # trained on Python sources, it writes printable text (an untrained byte model: ~37% printable bytes)
    printable = sum(ch.isprintable() or ch in "\n\t" for ch in completion) / len(completion)
    assert printable > 0.9, repr(completion)


@pytest.mark.slow
@pytest.mark.parametrize("case, message", [
    ("missing", "error: RUN_DIR_OR_CHECKPOINT: no such file or folder"),
    ("incompatible", "error: init_inference.checkpoint: training checkpoint"),
    ("heads", "error: transformer.h.*.attn.c_attn: its 4 heads do not split over tp_size=3"),
])
def test_a_missing_or_incompatible_checkpoint_is_one_line_and_exit_2(run_dir, case, message):
    if case == "missing":
        result = generate(run_dir / "nowhere")
    elif case == "incompatible":
        result = generate(run_dir, "model.n_embd=128")
    else:
        result = generate(run_dir, "launcher.num_procs=3")
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if not line.startswith("[dsrun] ")]  # not progress
    assert len(errors) == 1 and errors[0].startswith(message), result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_generate_says_what_it_does_before_importing_torch(tmp_path):
    """dsrun generate printed nothing for 49 s on a busy machine: parsing its options imported torch, then the
    checks and the ranks ran silently. Its first line now comes before torch is imported (here the source is
    missing, so the line is followed by the one-line error)."""
    seen, result = first_output_probe("generate", str(tmp_path / "no_run"), "--prompt", "def ", cwd=tmp_path)
    assert seen["line"] == f"[dsrun] checking {tmp_path / 'no_run'}: the model, its tokenizer and checkpoint"
    assert seen["loaded"] == [], seen
    assert seen["code"] == 2 and "error: RUN_DIR_OR_CHECKPOINT: no such file or folder" in result.stderr
