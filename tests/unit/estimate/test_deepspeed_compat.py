"""The four DeepSpeed-compatible estimators print the documented tables byte for byte.

Oracles: /work/shared/reference/api-inventory.md §2.1, the t5-3b examples of the DeepSpeed 0.14.1
"Memory Requirements" chapter (1 node x 8 GPUs, live and cold). The doc's text extraction collapsed runs of
spaces, so each table is checked twice: exactly against the bytes the documented format strings produce
(``f" {cpu:7.2f}GB | {gpu:6.2f}GB | {options}"``, header ``"  per CPU  |  per GPU |   Options"``, offload
device padded to four characters), and, after collapsing whitespace, against the doc's text as printed.
"""
from __future__ import annotations

import re

import pytest

from dsrun.estimate import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
from dsrun.estimate.deepspeed_compat import format_zero3_table
from tests.unit.estimate.t5_replica import t5_3b_on_meta, t5_large_on_meta

TITLE = "Estimated memory needed for params, optim states and gradients for a:"
HW_1x8 = "HW: Setup with 1 node, 8 GPUs per node."
HEADER = "  per CPU  |  per GPU |   Options"

ZERO2_LIVE = "\n".join([
    TITLE, HW_1x8,
    "SW: Model with 2851M total params.",
    HEADER,
    "  127.48GB |   5.31GB | offload_optimizer=cpu ",
    "  127.48GB |  15.93GB | offload_optimizer=none",
]) + "\n"

ZERO2_COLD = "\n".join([
    TITLE, HW_1x8,
    "SW: Model with 2851M total params.",
    HEADER,
    "  127.45GB |   5.31GB | offload_optimizer=cpu ",
    "  127.45GB |  15.93GB | offload_optimizer=none",
]) + "\n"

ZERO3_LIVE = "\n".join([
    TITLE, HW_1x8,
    "SW: Model with 2851M total params, 32M largest layer params.",
    HEADER,
    "   71.71GB |   0.12GB | offload_param=cpu , offload_optimizer=cpu , zero_init=1",
    "  127.48GB |   0.12GB | offload_param=cpu , offload_optimizer=cpu , zero_init=0",
    "   63.74GB |   0.79GB | offload_param=none, offload_optimizer=cpu , zero_init=1",
    "  127.48GB |   0.79GB | offload_param=none, offload_optimizer=cpu , zero_init=0",
    "    1.47GB |   6.10GB | offload_param=none, offload_optimizer=none, zero_init=1",
    "  127.48GB |   6.10GB | offload_param=none, offload_optimizer=none, zero_init=0",
]) + "\n"

ZERO3_COLD = "\n".join([
    TITLE, HW_1x8,
    "SW: Model with 2851M total params, 32M largest layer params.",
    HEADER,
    "   71.69GB |   0.12GB | offload_param=cpu , offload_optimizer=cpu , zero_init=1",
    "  127.45GB |   0.12GB | offload_param=cpu , offload_optimizer=cpu , zero_init=0",
    "   63.72GB |   0.78GB | offload_param=none, offload_optimizer=cpu , zero_init=1",
    "  127.45GB |   0.78GB | offload_param=none, offload_optimizer=cpu , zero_init=0",
    "    1.43GB |   6.09GB | offload_param=none, offload_optimizer=none, zero_init=1",
    "  127.45GB |   6.09GB | offload_param=none, offload_optimizer=none, zero_init=0",
]) + "\n"

# As printed in the documentation (whitespace collapsed by its text extraction), copied verbatim.
DOC_ZERO2_LIVE = """Estimated memory needed for params, optim states and gradients for a:
HW: Setup with 1 node, 8 GPUs per node.
SW: Model with 2851M total params.
per CPU | per GPU | Options
127.48GB | 5.31GB | offload_optimizer=cpu
127.48GB | 15.93GB | offload_optimizer=none"""

DOC_ZERO2_COLD = """Estimated memory needed for params, optim states and gradients for a:
HW: Setup with 1 node, 8 GPUs per node.
SW: Model with 2851M total params.
per CPU | per GPU | Options
127.45GB | 5.31GB | offload_optimizer=cpu
127.45GB | 15.93GB | offload_optimizer=none"""

DOC_ZERO3_LIVE = """Estimated memory needed for params, optim states and gradients for a:
HW: Setup with 1 node, 8 GPUs per node.
SW: Model with 2851M total params, 32M largest layer params.
    per CPU |    per GPU |    Options
      71.71GB |     0.12GB | offload_param=cpu , offload_optimizer=cpu , zero_init=1
     127.48GB |     0.12GB | offload_param=cpu , offload_optimizer=cpu , zero_init=0
      63.74GB |     0.79GB | offload_param=none, offload_optimizer=cpu , zero_init=1
     127.48GB |     0.79GB | offload_param=none, offload_optimizer=cpu , zero_init=0
      1.47GB |     6.10GB | offload_param=none, offload_optimizer=none, zero_init=1
     127.48GB |     6.10GB | offload_param=none, offload_optimizer=none, zero_init=0"""

# The cold ZeRO-3 example is a TAB-separated HTML table in the doc, from an older release that printed
# "None"; its numbers are the oracle, its markup and capital N are not (api-inventory.md §6).
DOC_ZERO3_COLD_ROWS = [
    ("71.69GB", "0.12GB", "cpu", "cpu", 1), ("127.45GB", "0.12GB", "cpu", "cpu", 0),
    ("63.72GB", "0.78GB", "None", "cpu", 1), ("127.45GB", "0.78GB", "None", "cpu", 0),
    ("1.43GB", "6.09GB", "None", "None", 1), ("127.45GB", "6.09GB", "None", "None", 0),
]


def _collapse(text: str) -> str:
    return "\n".join(re.sub(r"\s+", " ", line).strip() for line in text.strip().splitlines())


def test_zero2_live_prints_documented_table(capsys):
    estimate_zero2_model_states_mem_needs_all_live(t5_3b_on_meta(), num_gpus_per_node=8, num_nodes=1)
    out = capsys.readouterr().out
    assert out == ZERO2_LIVE
    assert _collapse(out) == _collapse(DOC_ZERO2_LIVE)


def test_zero2_cold_prints_documented_table(capsys):
    assert estimate_zero2_model_states_mem_needs_all_cold(total_params=2851e6, num_gpus_per_node=8,
                                                          num_nodes=1) is None
    out = capsys.readouterr().out
    assert out == ZERO2_COLD
    assert _collapse(out) == _collapse(DOC_ZERO2_COLD)


def test_zero3_live_prints_documented_table(capsys):
    estimate_zero3_model_states_mem_needs_all_live(t5_3b_on_meta(), num_gpus_per_node=8, num_nodes=1)
    out = capsys.readouterr().out
    assert out == ZERO3_LIVE
    assert _collapse(out) == _collapse(DOC_ZERO3_LIVE)


def test_zero3_cold_prints_documented_table(capsys):
    assert estimate_zero3_model_states_mem_needs_all_cold(total_params=2851e6, largest_layer_params=32e6,
                                                          num_gpus_per_node=8, num_nodes=1) is None
    out = capsys.readouterr().out
    assert out == ZERO3_COLD
    rows = out.splitlines()[4:]
    for row, (cpu, gpu, param, optim, init) in zip(rows, DOC_ZERO3_COLD_ROWS, strict=True):
        cells = [c.strip() for c in row.split("|")]
        assert cells[:2] == [cpu, gpu]
        assert cells[2] == f"offload_param={param.lower():4}, offload_optimizer={optim.lower():4}, zero_init={init}"


def test_default_arguments_are_deepspeeds(capsys):
    estimate_zero2_model_states_mem_needs_all_cold(1e9)
    assert capsys.readouterr().out.splitlines()[1] == "HW: Setup with 1 node, 1 GPU per node."


def test_exact_byte_returns_of_the_helpers():
    # api-inventory.md §2.1 "Exact integer returns" (total=2851e6, largest=32e6, 8 GPUs x 1 node).
    assert estimate_zero2_model_states_mem_needs(2851e6, 8, 1, cpu_offload=True) == (136848000000, 5702000000)
    assert estimate_zero2_model_states_mem_needs(2851e6, 8, 1, cpu_offload=False) == (136848000000, 17106000000)
    expected = {
        (True, True, True): (76977000000, 128000000), (True, True, False): (136848000000, 128000000),
        (True, False, True): (68424000000, 840750000), (True, False, False): (136848000000, 840750000),
        (False, False, True): (1536000000, 6542750000), (False, False, False): (136848000000, 6542750000),
    }
    for (opt, param, init), (cpu, gpu) in expected.items():
        got = estimate_zero3_model_states_mem_needs(2851e6, 32e6, 8, 1, opt, param, init)
        assert got == (cpu, gpu, 128000000), (opt, param, init)


@pytest.mark.parametrize("cpu_offload, expected", [(True, (254.90, 5.31)), (False, (127.45, 13.28))])
def test_zero2_two_nodes_uses_total_gpus_like_the_code(cpu_offload, expected):
    cpu, gpu = estimate_zero2_model_states_mem_needs(2851e6, 8, 2, cpu_offload=cpu_offload)
    assert (round(cpu / 2**30, 2), round(gpu / 2**30, 2)) == expected


def test_zero3_two_nodes_rows():
    text = format_zero3_table(2851e6, 32e6, num_gpus_per_node=8, num_nodes=2)
    assert text.splitlines()[1] == "HW: Setup with 2 nodes, 8 GPUs per node."
    cells = [[c.strip() for c in row.split("|")[:2]] for row in text.splitlines()[4:]]
    assert cells == [["35.85GB", "0.12GB"], ["127.45GB", "0.12GB"], ["31.86GB", "0.45GB"],
                     ["127.45GB", "0.45GB"], ["1.43GB", "3.11GB"], ["127.45GB", "3.11GB"]]


def test_t5_large_discussion_example():
    # The doc's worked example: t5-large on 4 GPUs, printed in MiB.
    total, largest = 737_668_096, 32_899_072
    from dsrun.estimate import count_parameters

    counts = count_parameters(t5_large_on_meta())
    assert (counts.total, counts.largest_layer) == (total, largest)
    mib = [estimate_zero3_model_states_mem_needs(total, largest, 4, 1, opt, param, True)[1] >> 20
           for opt, param in [(False, False), (True, True), (True, False)]]
    assert mib == [3291, 125, 477]
