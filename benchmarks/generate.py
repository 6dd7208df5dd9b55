"""Generation speed: the fused KV-cache path (``replace_with_kernel_inject=True``) against the plain model.

The plain model is dsrun's GPT behind ``init_inference`` without kernel injection: its ``generate`` runs the
whole context through the blocks again for every token. The fused path runs the prompt once and then one
token per forward over a key/value cache; ``--int8`` adds the fused path with weight-only INT8 linears.
Every configuration greedily generates the same tokens (checked) from the same random-weight model; they take
turns, one generation each per round, so load from other processes hits them alike, and the table reports
medians over the rounds. Tokens/s counts new tokens over the whole ``generate`` call (prompt included).

    python benchmarks/generate.py [--model gpt-mini] [--prompt-tokens 32] [--new-tokens 192] [--rounds 5]
                                  [--batch 1] [--threads 1] [--int8] [--json out.json]

The machine's load average is printed before and after: timings taken under load are only comparable
within one run (the ratio), not across runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-mini", help="a conf/model size (default gpt-mini)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--int8", action="store_true", help="also time the fused path with INT8 weights")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)

    import torch

    import dsrun
    from dsrun.models.registry import build_model

    torch.set_num_threads(args.threads)
    print(f"load average before: {load()}  (threads per process: {args.threads})", flush=True)

    def engine(**settings):
        torch.manual_seed(0)
        model = build_model(args.model)
        return dsrun.init_inference(model, dtype=settings.pop("dtype", torch.float32),
                                    max_out_tokens=model.config.block_size, **settings)

    configs = {"plain": engine(), "fused": engine(replace_with_kernel_inject=True)}
    if args.int8:
        configs["fused-int8"] = engine(replace_with_kernel_inject=True, dtype=torch.int8)
    block_size = configs["plain"].module.config.block_size
    if args.prompt_tokens + args.new_tokens > block_size:
        parser.error(f"--prompt-tokens + --new-tokens must fit the model's block_size={block_size}")
    vocab = configs["plain"].module.config.vocab_size
    prompt = torch.randint(0, vocab, (args.batch, args.prompt_tokens), generator=torch.Generator().manual_seed(1))
    seconds: dict[str, list[float]] = {name: [] for name in configs}
    outputs: dict[str, torch.Tensor] = {}
    for name, eng in configs.items():  # warm-up, and the tokens to compare
        outputs[name] = eng.generate(prompt, args.new_tokens, temperature=0)
    for _ in range(args.rounds):
        for name, eng in configs.items():
            start = time.perf_counter()
            eng.generate(prompt, args.new_tokens, temperature=0)
            seconds[name].append(time.perf_counter() - start)
    same = torch.equal(outputs["plain"], outputs["fused"])
    tokens = args.batch * args.new_tokens
    rates = {name: tokens / statistics.median(times) for name, times in seconds.items()}
    print(f"{args.model}: prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, batch {args.batch}, "
          f"{args.rounds} rounds (medians)")
    print(f"{'path':<12}{'tokens/s':>12}{'vs plain':>10}")
    for name, rate in rates.items():
        print(f"{name:<12}{rate:>12.1f}{rate / rates['plain']:>9.2f}x")
    print(f"fused and plain generate the same tokens: {same}")
    if "fused-int8" in outputs:
        agree = (outputs["fused-int8"] == outputs["fused"]).float().mean().item()
        print(f"int8 tokens equal to fp32 tokens: {agree:.1%}")
    print(f"load average after: {load()}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rates": rates,
                                         "seconds": seconds, "same_tokens": same}, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
