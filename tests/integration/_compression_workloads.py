"""Quantization-aware training of dsrun's GPT under ZeRO stages 0, 2 and 3 (rank entry points)."""
from __future__ import annotations

from typing import Any

from tests.harness.runs import engine_run
from tests.harness.runs import zero3_config as ds_config

STEPS = 50
# 8 -> 4 bits (grouped) with activation quantization, and learned sparse masks (their scores are ZeRO
# parameters like any other)
QAT = {
    "weight_quantization": {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "quantize_groups": 4,
                              "schedule_offset": 5},
        "different_groups": {"wq1": {"params": {"start_bits": 8, "target_bits": 4, "quantization_period": 10},
                                     "modules": ["*"]}}},
    "activation_quantization": {
        "shared_parameters": {"enabled": True, "schedule_offset": 10},
        "different_groups": {"aq1": {"params": {"bits": 8}, "modules": ["attn"]}}},
    "sparse_pruning": {
        "shared_parameters": {"enabled": True, "method": "topk", "schedule_offset": 15},
        "different_groups": {"sp1": {"params": {"dense_ratio": 0.5}, "modules": ["mlp.c_fc"]}}},
}
CASES = {"stage0": (0, False), "stage2": (2, False), "stage3": (3, False), "stage3_zero_init": (3, True)}


def qat_suite(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for name, (stage, zero_init) in CASES.items():
        config = ds_config(stage, 2, 1, compression_training=QAT)
        out[name] = engine_run("nanogpt", config, STEPS, rank, world, zero_init=zero_init)
    return out
