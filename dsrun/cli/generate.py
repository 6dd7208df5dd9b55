"""Generate text with a trained model: the run's GPT, its tokenizer and its latest checkpoint.

Examples:
  dsrun generate outputs/2026-11-22/09-37-12 --prompt "def main("
  dsrun generate outputs/2026-11-22/09-37-12 --prompt "import " --max-new-tokens 200 --temperature 0.7 --top-k 40
  dsrun generate outputs/2026-11-22/09-37-12 --prompt "class " launcher.num_procs=2   (tensor parallelism, 2 ranks)
  dsrun generate RUN_DIR/checkpoints/global_step200 --prompt "x = "               (one checkpoint tag)
  dsrun generate exported/pytorch_model.bin --prompt "x" model=gpt-nano           (a model file, no run dir)

RUN_DIR_OR_CHECKPOINT is a run directory (its checkpoints/ folder), a checkpoint folder (holding 'latest'),
one tag's folder, or a state-dict file (save_16bit_model, zero_to_fp32). The model and tokenizer come from
the nearest resolved.yaml at or above it; model=NAME and model.KEY=VALUE name them otherwise. The model is
split over every rank of the launch (launcher.num_procs=N: TP=N); the line after the text reports tokens/s.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from pathlib import Path

from dsrun.utils.errors import Problem, UserError

INTERMIXED_ARGS = True  # overrides may come after the options: SOURCE --prompt TEXT launcher.num_procs=2


DTYPES = ("fp32", "bf16", "fp16", "int8")  # --dtype; kept here so that parsing the command needs no torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("source", metavar="RUN_DIR_OR_CHECKPOINT",
                        help="a run directory, a checkpoint folder or tag folder, or a model file")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate (default 100)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="sampling temperature; 0 picks the most likely token (default 0.8)")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens only")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the sampling (default 1234)")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32",
                        help="weights and activations; int8 = weight-only INT8 (default fp32)")
    parser.add_argument("--no-kernel-inject", dest="kernel_inject", action="store_false",
                        help="run the plain model (full recomputation per token) instead of the fused "
                             "KV-cache path")
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE",
                        help="launcher.KEY=VALUE (launcher.num_procs=2: TP over 2 ranks), model=NAME, "
                             "model.KEY=VALUE, data.tokenizer=SPEC")


def run(args: argparse.Namespace) -> int:
    from dsrun.cli.common import say_stage

    if args.max_new_tokens < 1:
        raise UserError(Problem("--max-new-tokens", f"got {args.max_new_tokens}; must be at least 1"))
    if args.top_k is not None and args.top_k < 1:
        raise UserError(Problem("--top-k", f"got {args.top_k}; must be at least 1"))
    # the first line comes before torch is imported: on a busy machine the command was silent for most of a minute
    say_stage(f"checking {args.source}: the model, its tokenizer and checkpoint", err=True)
    from dsrun.inference.textgen import WORKER, resolve_request, run_request, summary_line
    from dsrun.launcher import launch_from_mapping
    from dsrun.launcher.execute import JobOutcome

    request, launcher, world = resolve_request(args.source, args.prompt, args.overrides,
                                               max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                               top_k=args.top_k, seed=args.seed, dtype=args.dtype,
                                               kernel_inject=args.kernel_inject)
    if world == 1:
        say_stage("loading the model and generating", err=True)
        result = run_request(request)
    else:
        say_stage(f"starting {world} ranks (tensor parallel); each imports torch and loads its part of the model",
                  err=True)
        with tempfile.TemporaryDirectory(prefix="dsrun-generate-") as tmp:
            request_file, result_file = Path(tmp) / "request.json", Path(tmp) / "result.json"
            request_file.write_text(json.dumps(request.to_dict()))
            outcome = JobOutcome()
            code = launch_from_mapping(launcher, WORKER, ["--request", str(request_file), "--result",
                                                          str(result_file)], module=True, outcome=outcome)
            if outcome.user_errors:  # a rank's report of the user's mistake: once, as any UserError
                raise UserError(outcome.user_errors)
            if outcome.signal is not None:
                print(f"[dsrun] generation stopped by {signal.Signals(outcome.signal).name}", file=sys.stderr)
                return code
            if code != 0 or not result_file.is_file():
                print(f"[dsrun] generation failed (exit code {code}); see the rank output above", file=sys.stderr)
                return code or 1
            result = json.loads(result_file.read_text())
    print(result["text"], flush=True)
    print(summary_line(result), file=sys.stderr, flush=True)
    return 0
