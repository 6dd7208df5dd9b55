"""Schedules (bits over steps, offsets, densities) against hand-computed tables."""
import torch

from dsrun.compression import compression_scheduler, init_compression
from dsrun.compression.moq import moq_switch_steps
from dsrun.compression.pruning import snip_density
from dsrun.compression.scheduler import bits_started_at, mixed_share, weight_bits_at

from .conftest import merge, technique


def test_weight_bits_drop_one_bit_every_period_after_the_offset():
    # offset 10, 8 -> 4 bits, period 5
    table = {0: None, 9: None, 10: 8, 14: 8, 15: 7, 19: 7, 20: 6, 25: 5, 29: 5, 30: 4, 100: 4}
    assert {s: weight_bits_at(s, 10, 8, 4, 5) for s in table} == table
    assert weight_bits_at(3, 0, 8, 2, 0) == 2  # period 0: straight to the target


def test_mixed_quantize_share_restarts_with_each_bit_width():
    # quantize_change_ratio 0.25: the quantized share of each new bit width goes 0.25, 0.5, 0.75, 1
    shares = [mixed_share(s, bits_started_at(s, 10, 8, 4, 5), 0.25) for s in range(10, 17)]
    assert shares == [0.25, 0.5, 0.75, 1.0, 1.0, 0.25, 0.5]


def test_snip_density_cubic_ramp_on_the_stride():
    # offset 10, end 40, stride 10, dense_ratio 0.2: d + (1-d)(1-p)^3 at p = 0, 1/3, 2/3, then d
    expected = {5: 1.0, 10: 1.0, 19: 1.0, 20: 0.2 + 0.8 * (2 / 3) ** 3, 29: 0.2 + 0.8 * (2 / 3) ** 3,
                30: 0.2 + 0.8 / 27, 40: 0.2, 90: 0.2}
    for step, density in expected.items():
        assert abs(snip_density(step, 10, 40, 10, 0.2) - density) < 1e-12, step


def test_moq_period_doubles_after_each_switch():
    assert moq_switch_steps(0, 100, 16, 13) == [100, 300, 700]
    assert moq_switch_steps(50, 10, 8, 6) == [60, 80]
    # an eigenvalue factor of 2 at the first switch stretches every later period
    assert moq_switch_steps(0, 100, 16, 13, factors=lambda k: [2, 1, 1][k]) == [100, 500, 1300]


def test_each_technique_switches_on_at_its_schedule_offset(two_layer):
    config = merge(
        technique("weight_quantization", {"quantize_weight_in_forward": True, "schedule_offset": 2},
                  {"start_bits": 8, "target_bits": 6, "quantization_period": 2}),
        technique("activation_quantization", {"schedule_offset": 3}, {"bits": 8}),
        technique("sparse_pruning", {"schedule_offset": 1}, {"dense_ratio": 0.5}, modules=["fc1"]),
        technique("row_pruning", {"schedule_offset": 4}, {"dense_ratio": 0.5}, modules=["fc2"]))
    init_compression(two_layer, config)
    scheduler = compression_scheduler(two_layer)
    scheduler.step(step_zero_check=True)
    seen = []
    for _ in range(7):
        fc1, fc2 = two_layer.fc1.ds_compression, two_layer.fc2.ds_compression
        seen.append((scheduler.training_steps, fc1.weight.bits, fc1.activation.active,
                     fc1.prunings["sparse"].active, fc2.prunings["row"].active))
        scheduler.step()
    assert seen == [(0, None, False, False, False), (1, None, False, True, False), (2, 8, False, True, False),
                    (3, 8, True, True, False), (4, 7, True, True, True), (5, 7, True, True, True),
                    (6, 6, True, True, True)]


def test_l1_mask_recomputed_every_stride_until_schedule_offset_end(two_layer):
    config = technique("sparse_pruning", {"schedule_offset": 0, "schedule_offset_end": 4, "schedule_offset_stride": 2},
                       {"dense_ratio": 0.5}, modules=["fc1"])
    init_compression(two_layer, config)
    scheduler = compression_scheduler(two_layer)
    scheduler.step(step_zero_check=True)
    masks = []
    for step in range(1, 7):
        with torch.no_grad():  # weights move between steps, as training would move them
            two_layer.fc1.weight.copy_(torch.randn(32, 16, generator=torch.Generator().manual_seed(step)))
        scheduler.step()
        masks.append(two_layer.fc1.sparse_pruning_mask.clone())
    changed = [not torch.equal(a, b) for a, b in zip(masks, masks[1:])]
    # steps 2 and 4 recompute (stride 2, end 4); steps 3, 5, 6 keep the mask
    assert changed == [True, False, True, False, False]
