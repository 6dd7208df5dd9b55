"""The estimator's comm volume per optimizer step (dsrun/estimate/comm_volume.py): the ZeRO paper's
3 psi against 2 psi, and ZeRO++'s quantized bytes (qwZ, qgZ) from the message layout of
dsrun/comm/quantized.py."""
from __future__ import annotations

import pytest

from dsrun.comm import quantized as q
from dsrun.estimate.comm_volume import step_comm_volume
from dsrun.estimate.inputs import BufferSettings, EstimateInputs

PSI = 1_000_000


def spec(stage: int = 3, precision: str = "fp32", nodes: int = 1, per_node: int = 4, **zero) -> EstimateInputs:
    return EstimateInputs(total_params=PSI, largest_layer_params=PSI // 10, ranks_per_node=per_node, nodes=nodes,
                          zero_stage=stage, precision=precision, buffers=BufferSettings.from_zero_config(zero))


def test_stage3_moves_one_and_a_half_times_stage0() -> None:
    s0, s3 = step_comm_volume(spec(0)), step_comm_volume(spec(3))
    assert (s0.gradient_op, s3.gradient_op) == ("all_reduce", "reduce_scatter")
    assert s3.traffic_bytes == pytest.approx(1.5 * s0.traffic_bytes)
    assert s3.gather_bytes == 2 * PSI * 4 and s3.gradient_bytes == PSI * 4


@pytest.mark.parametrize("precision,element", [("fp32", 4), ("bf16", 2)])
def test_quantized_weights_and_gradients(precision: str, element: int) -> None:
    base = step_comm_volume(spec(precision=precision))
    qwz = step_comm_volume(spec(precision=precision, zero_quantized_weights=True))
    qgz = step_comm_volume(spec(precision=precision, zero_quantized_gradients=True))
    assert qwz.gather_bytes / base.gather_bytes == pytest.approx((1 + 4 / q.WEIGHT_BLOCK) / element)
    assert qwz.gradient_bytes == base.gradient_bytes
    assert qgz.gradient_op == "all_to_all_single"
    assert qgz.gradient_bytes / base.gradient_bytes == pytest.approx((0.5 + 4 / q.GRAD_BLOCK) / element)
    assert qwz.gather_bytes / base.gather_bytes <= 0.55 and qgz.gradient_bytes / base.gradient_bytes <= 0.3


def test_qgz_across_nodes_adds_the_inter_node_all_to_all() -> None:
    one = step_comm_volume(spec(nodes=1, per_node=8, zero_quantized_gradients=True))
    two = step_comm_volume(spec(nodes=2, per_node=4, zero_quantized_gradients=True))
    assert two.gradient_bytes == pytest.approx(one.gradient_bytes * (1 + 1 / 4))


def test_one_rank_communicates_nothing() -> None:
    assert step_comm_volume(spec(per_node=1)).traffic_bytes == 0.0


def test_mics_and_hpz_keep_message_bytes_and_change_what_leaves_the_rank() -> None:
    """8 ranks, fp32: MiCS over shard groups of 2 sends the same messages, 1/2 of them leave the rank, plus
    the all-reduce of the fp32 gradient partition across the 4 replicas; hpZ over 2 ranks keeps the
    backward gathers (half the gathered bytes) inside the pair."""
    plain = step_comm_volume(spec(per_node=8))
    mics = step_comm_volume(EstimateInputs(**{**spec(per_node=8).__dict__, "mics_shard_size": 2}))
    hpz = step_comm_volume(EstimateInputs(**{**spec(per_node=8).__dict__, "hpz_partition_size": 2}))
    assert (mics.gather_bytes, mics.gradient_bytes) == (plain.gather_bytes, plain.gradient_bytes)
    assert mics.replica_bytes == PSI * 4 // 2 and plain.replica_bytes == hpz.replica_bytes == 0
    assert mics.traffic_bytes == pytest.approx((3 * PSI * 4) / 2 + 2 * (PSI * 4 // 2) * 3 / 4)
    assert hpz.traffic_bytes == pytest.approx(2 * PSI * 4 * 7 / 8 + PSI * 4 / 2)


def test_quantized_nontrainable_weights_gather_the_frozen_share_at_int8() -> None:
    half = EstimateInputs(total_params=PSI, largest_layer_params=PSI // 10, ranks_per_node=4, zero_stage=3,
                          trainable_params=PSI // 2,
                          buffers=BufferSettings.from_zero_config({"zero_quantized_nontrainable_weights": True}))
    base = step_comm_volume(EstimateInputs(**{**half.__dict__, "buffers": BufferSettings()}))
    assert step_comm_volume(half).gather_bytes == pytest.approx(base.gather_bytes / 2 * (1 + (1 + 4 / 256) / 4))


def test_an_all_reduce_fetch_sends_the_gathered_bytes_twice() -> None:
    """stage3_use_all_reduce_for_fetch_params: the same message bytes, twice the traffic of the gathers (an
    all-reduce leaves 2 (N-1)/N of its tensor), except hpZ's secondary backward gathers, which stay all-gathers."""
    plain, reduced = step_comm_volume(spec()), step_comm_volume(spec(stage3_use_all_reduce_for_fetch_params=True))
    assert reduced.gather_bytes == plain.gather_bytes == 2 * PSI * 4
    assert reduced.traffic_bytes == pytest.approx(plain.traffic_bytes + 2 * PSI * 4 * 3 / 4)
    hpz = {**spec(per_node=8, stage3_use_all_reduce_for_fetch_params=True).__dict__, "hpz_partition_size": 2}
    assert step_comm_volume(EstimateInputs(**hpz)).traffic_bytes == pytest.approx(
        2 * PSI * 4 * 7 / 8 + PSI * 4 / 2 + PSI * 4 * 7 / 8)  # the forward's all-reduce adds its bytes once more
