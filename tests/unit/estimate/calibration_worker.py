"""One "rank" of the calibration test: plain PyTorch AdamW steps on the test GPT, peak recorded with the
same hook a dsrun rank uses (``current_rss`` before the model, ``write_rank_peak`` after the steps).

Run as ``python -m tests.unit.estimate.calibration_worker CONFIG_JSON OUT_DIR``; fp32 on one rank is what
ZeRO stage 0 holds, so the estimate for that setting is compared with it.
"""
from __future__ import annotations

import json
import sys

import torch

from dsrun.estimate.measure import current_rss, rank_peak_bytes, write_rank_peak
from tests.unit.estimate.tiny_gpt import TinyGPT


def main(config: dict, out_dir: str, steps: int = 2) -> None:
    torch.manual_seed(0)
    batch, seq = config.pop("micro_batch"), config.pop("seq_len")
    (torch.ones(8, requires_grad=True) * 2).sum().backward()  # start autograd's machinery before the baseline
    baseline = current_rss()
    model = TinyGPT(**config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, config["vocab_size"], (batch, seq))
    for _ in range(steps):
        _, loss = model(idx, idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    write_rank_peak(out_dir, 0, rank_peak_bytes(baseline))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2])
