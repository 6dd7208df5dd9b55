"""ZeRO++ at stage 3 on two gloo ranks (one launch, tests/integration/_zeropp_workloads.py) and the
hierarchical quantized reduce-scatter on four (two "nodes" of two). Bytes are the comms logger's exact
message bytes; results are compared with plain-torch simulations (tests/unit/comm/test_quantized.py)."""
from __future__ import annotations

import pytest
import torch

from dsrun.comm import quantized as q
from dsrun.estimate.inputs import BufferSettings, EstimateInputs
from dsrun.estimate.model_states import model_state_bytes
from tests.helpers import run_ranks
from tests.integration import _zeropp_workloads as w
from tests.unit.comm.test_quantized import simulate_all_gather, simulate_reduce_scatter

WORLD = 2


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(w.engines, WORLD, timeout=600)


def _bytes(case: dict, op: str) -> int:
    return sum(size * count for size, count in case["sizes"].get(op, {}).items())


def _check_collectives(results: list[dict], world: int, node_sizes: tuple[int, ...]) -> None:
    shards, rows = w.collective_inputs(world, seed=7)
    gathered = simulate_all_gather(shards)
    for rank, out in enumerate(results):
        assert torch.equal(out["gather"], gathered)
        assert torch.equal(out["gather_bf16"], gathered.to(torch.bfloat16))
        for node in node_sizes:
            result, hierarchical = out[f"reduce/{node}"]
            assert hierarchical == (node < world)
            assert torch.equal(result, simulate_reduce_scatter(rows, node)[rank])


def test_collectives_equal_the_plain_torch_simulation(ranks: list[dict]) -> None:
    _check_collectives([r["collectives"] for r in ranks], WORLD, (WORLD, 1))


def test_hierarchical_reduce_scatter_on_two_nodes_of_two() -> None:
    _check_collectives(run_ranks(w.collectives, 4, (4, 2), timeout=300), 4, (4, 2))


def _expected_gather_bytes(plain: dict, element: int, quantized_sizes=None) -> int:
    """The all-gathers of ``plain`` with each quantized one's message replaced by N INT8 messages."""
    total = 0
    for size, count in plain["sizes"]["all_gather"].items():
        part = size // (WORLD * element)
        if quantized_sizes is None or size in quantized_sizes:
            total += count * WORLD * q.message_bytes(part, 8, q.WEIGHT_BLOCK)
        else:
            total += count * size
    return total


def test_quantized_weights_gather_int8_blocks(ranks: list[dict]) -> None:
    """zero_quantized_weights: every stage-3 all-gather carries INT8 codes plus one fp32 scale per block."""
    for rank in ranks:
        for base, element, case in (("plain", 4, "qwz"), ("plain_bf16", 2, "both_bf16")):
            assert _bytes(rank[case], "all_gather") == _expected_gather_bytes(rank[base], element)
            ratio = _bytes(rank[case], "all_gather") / _bytes(rank[base], "all_gather")
            assert ratio <= 0.55, (base, ratio)
        assert rank["qwz"]["losses"] != rank["plain"]["losses"]  # the forward ran on the dequantized weights
        assert rank["qwz"]["exact"]  # GatheredParameters gathers (and writes back) the exact values


def _first_loss_bound(rank: int) -> float:
    """|loss(dequantized weights) - loss(weights)| at the first step, to first order: the sum over
    elements of |dloss/dw| times the element's bound (its block scale / 2), doubled for the higher-order
    terms (the weights move by at most 1/254 of their block's largest magnitude)."""
    import torch.nn.functional as F

    model = w._model(False)
    x, y = w.batch(0, rank)
    F.mse_loss(model(x), y).backward()
    bound = 0.0
    for p in model.parameters():
        flat, grad = p.detach().reshape(-1), p.grad.reshape(-1)
        part = -(-flat.numel() // WORLD)
        padded = torch.cat([flat, flat.new_zeros(part * WORLD - flat.numel())])
        for r in range(WORLD):
            scales = q.quantize(padded[r * part:(r + 1) * part], 8, q.WEIGHT_BLOCK)[1]
            per_element = scales.repeat_interleave(q.WEIGHT_BLOCK)[:part][: max(0, flat.numel() - r * part)]
            bound += float((grad[r * part:r * part + per_element.numel()].abs() * per_element / 2).sum())
    return 2 * bound


def test_losses_stay_close_to_plain_zero3(ranks: list[dict]) -> None:
    for rank, out in enumerate(ranks):
        plain = out["plain"]["losses"]
        assert abs(out["qwz"]["losses"][0] - plain[0]) <= _first_loss_bound(rank)
        assert out["qgz"]["losses"][0] == plain[0]  # gradients are quantized: the first forward is exact
        for case in ("qwz", "qgz", "both"):
            for a, b in zip(out[case]["losses"], plain):
                assert abs(a - b) <= 0.02 * abs(b), (case, out[case]["losses"], plain)


def test_quantized_gradients_int4_all_to_all(ranks: list[dict]) -> None:
    """zero_quantized_gradients: no reduce-scatter; the all-to-all carries packed INT4 codes and scales."""
    for rank in ranks:
        for base, case in (("plain", "qgz"), ("plain_bf16", "both_bf16")):
            assert "reduce_scatter" not in rank[case]["sizes"]
            element = 4 if base == "plain" else 2
            expected = sum(count * WORLD * q.message_bytes(size // (WORLD * element), 4, q.GRAD_BLOCK)
                           for size, count in rank[base]["sizes"]["reduce_scatter"].items())
            assert _bytes(rank[case], "all_to_all_single") == expected
            ratio = expected / _bytes(rank[base], "reduce_scatter")
            assert ratio <= 0.3, (base, ratio)
        assert rank["qgz"]["losses"][1:] != rank["plain"]["losses"][1:]  # the update used the quantized sum


def test_nontrainable_weights_gather_quantized(ranks: list[dict]) -> None:
    """zero_quantized_nontrainable_weights: the frozen Linear's gathers are INT8, the trainable ones exact."""
    frozen_sizes = {WORLD * -(-n // WORLD) * 4 for n in (w.IN * w.HIDDEN, w.HIDDEN)}  # the first Linear's
    for rank in ranks:
        plain, quantized = rank["frozen"], rank["frozen_nontrainable"]
        assert frozen_sizes <= set(plain["sizes"]["all_gather"])
        assert _bytes(quantized, "all_gather") == _expected_gather_bytes(plain, 4, frozen_sizes)
        assert _bytes(quantized, "all_gather") < _bytes(plain, "all_gather")
        assert quantized["losses"] != plain["losses"]


def _frozen_layer_scales(value: torch.Tensor) -> torch.Tensor:
    """Per element of ``value`` (a frozen weight): the scale of the INT8 block it is kept in (its rank's
    shard of the flat, padded tensor, quantized on its own)."""
    flat = value.detach().reshape(-1)
    part = -(-flat.numel() // WORLD)
    padded = torch.cat([flat, flat.new_zeros(part * WORLD - flat.numel())])
    per_shard = [q.quantize(padded[r * part:(r + 1) * part], 8, q.WEIGHT_BLOCK)[1].repeat_interleave(q.WEIGHT_BLOCK)[:part]
                 for r in range(WORLD)]
    return torch.cat(per_shard)[:flat.numel()].view_as(value)


def test_nontrainable_weights_kept_int8(ranks: list[dict]) -> None:
    """zero_quantized_nontrainable_weights: each rank holds the frozen Linear's shards as INT8 codes plus
    one fp32 scale per block (exact byte count), the trainable ones in fp32; the estimator predicts it."""
    frozen_parts = [-(-n // WORLD) for n in (w.IN * w.HIDDEN, w.HIDDEN)]
    trainable_parts = [-(-n // WORLD) for n in (w.HIDDEN * w.OUT, w.OUT)]
    for rank in ranks:
        kept = sum(q.message_bytes(part, 8, q.WEIGHT_BLOCK) for part in frozen_parts)
        assert rank["frozen"]["parameter_bytes"] == 4 * (sum(frozen_parts) + sum(trainable_parts))
        assert rank["frozen_nontrainable"]["parameter_bytes"] == kept + 4 * sum(trainable_parts)
        assert kept <= 0.26 * 4 * sum(frozen_parts)
        # the estimator's count for this model: here the per-parameter blocks add up to the flat count
        spec = EstimateInputs(total_params=w.IN * w.HIDDEN + w.HIDDEN + w.HIDDEN * w.OUT + w.OUT,
                              trainable_params=w.HIDDEN * w.OUT + w.OUT, largest_layer_params=w.IN * w.HIDDEN,
                              ranks_per_node=WORLD, zero_stage=3, precision="fp32", small_params=0,
                              buffers=BufferSettings(zero_quantized_nontrainable_weights=True))
        assert model_state_bytes(spec).device_params == rank["frozen_nontrainable"]["parameter_bytes"]


def test_nontrainable_weights_compute_with_the_kept_values(ranks: list[dict]) -> None:
    """The frozen Linear computes with the dequantized weights: its first output is within the quantization
    step's bound of the exact one (each weight within scale / 2), equal bit for bit to a plain run whose
    frozen weights were set to the kept values; the trainable weights and losses of that run are equal
    bit for bit too (the key changes nothing but the frozen values)."""
    layer = w._model(True)[0]
    weight_scale, bias_scale = _frozen_layer_scales(layer.weight), _frozen_layer_scales(layer.bias)
    eps = torch.finfo(torch.float32).eps
    for r, rank in enumerate(ranks):
        kept, plain, reference = rank["frozen_nontrainable"], rank["frozen"], rank["frozen_dequantized"]
        x = w.batch(0, r)[0].double()
        exact = x @ layer.weight.double().T + layer.bias.double()
        quant_bound = x.abs() @ (weight_scale.double() / 2).T + bias_scale.double() / 2
        # fp32 rounding of the two products of IN terms (gamma_n bound, twice: both runs round)
        rounding = 2 * (w.IN + 1) * eps * (x.abs() @ layer.weight.double().abs().T + layer.bias.double().abs())
        assert torch.all((plain["first_hidden"].double() - exact).abs() <= rounding / 2)
        assert torch.all((kept["first_hidden"].double() - exact).abs() <= quant_bound + rounding)
        assert not torch.equal(kept["first_hidden"], plain["first_hidden"])
        assert torch.equal(kept["first_hidden"], reference["first_hidden"])
        assert kept["losses"] == reference["losses"]
        for a, b in zip(kept["trainable"] + kept["frozen"], reference["trainable"] + reference["frozen"]):
            assert torch.equal(a, b)
        for value, original in zip(kept["frozen"], layer.parameters()):
            assert torch.equal(value, w.kept_frozen_value(original, WORLD))


def test_nontrainable_weights_resume_exactly(ranks: list[dict]) -> None:
    """A checkpoint keeps the frozen shards as held (INT8 messages besides the full-precision fragments):
    a fresh engine with other weights loads them byte for byte and trains on as the saved one did."""
    for rank in ranks:
        resume = rank["frozen_nontrainable"]["resume"]
        assert all(resume["changed_before_load"]) and all(resume["loaded_exactly"])
        assert resume["resumed"] == resume["losses"]
        for a, b in zip(resume["weights"], resume["resumed_weights"]):
            assert torch.equal(a, b)
