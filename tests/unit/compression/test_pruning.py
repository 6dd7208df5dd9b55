"""Pruning: exact densities, block patterns, learned masks, and structured pruning that really shrinks."""
import pytest
import torch
from torch import nn

from dsrun.compression import compression_scheduler, init_compression, redundancy_clean
from dsrun.compression.pruning import keep_count, topk_mask
from dsrun.models.gpt import GPT
from dsrun.utils.errors import UserError

from .conftest import TwoLayer, technique


def _start(model, config):
    init_compression(model, config)
    scheduler = compression_scheduler(model)
    scheduler.step(step_zero_check=True)
    return scheduler


@pytest.mark.parametrize("ratio", [0.25, 0.3, 0.9])
def test_l1_sparse_pruning_keeps_exactly_the_dense_ratio(two_layer, ratio):
    config = technique("sparse_pruning", {"schedule_offset": 0, "method": "l1"}, {"dense_ratio": ratio}, ["fc1"])
    _start(two_layer, config)
    weight = two_layer.fc1.weight.detach().clone()
    redundancy_clean(two_layer, config)
    kept = (two_layer.fc1.weight != 0).sum().item()
    assert kept == keep_count(512, ratio) == round(512 * ratio)
    # the largest magnitudes survive
    assert two_layer.fc1.weight.abs().max() == weight.abs().max()
    assert weight.abs()[two_layer.fc1.weight == 0].max() <= weight.abs()[two_layer.fc1.weight != 0].min()


def test_block_pattern_4x1_prunes_whole_blocks(two_layer):
    config = technique("sparse_pruning", {"schedule_offset": 0, "block_pattern": "4x1"}, {"dense_ratio": 0.5}, ["fc1"])
    _start(two_layer, config)
    mask = two_layer.fc1.sparse_pruning_mask
    blocks = mask.reshape(8, 4, 16)
    assert torch.equal(blocks.all(dim=1), blocks.any(dim=1))  # each 4x1 block all kept or all pruned
    assert mask.sum().item() == 256


def test_block_pattern_n_of_m_keeps_n_per_run(two_layer):
    config = technique("sparse_pruning", {"schedule_offset": 0, "block_pattern": "2:4"}, {"dense_ratio": 0.5}, ["fc1"])
    _start(two_layer, config)
    assert torch.equal(two_layer.fc1.sparse_pruning_mask.reshape(32, 4, 4).sum(-1), torch.full((32, 4), 2))
    with pytest.raises(UserError, match="keeps at least 2 of every 4"):
        init_compression(TwoLayer(), technique("sparse_pruning", {"block_pattern": "2:4"}, {"dense_ratio": 0.25}))


def test_excluded_modules_are_not_pruned(two_layer):
    config = technique("sparse_pruning", {"schedule_offset": 0, "excluded_modules": ["fc2"]}, {"dense_ratio": 0.5})
    _start(two_layer, config)
    redundancy_clean(two_layer, config)
    assert (two_layer.fc1.weight == 0).float().mean() == 0.5 and (two_layer.fc2.weight != 0).all()


def test_topk_mask_follows_learned_scores_and_freezes_at_schedule_offset_end(two_layer):
    config = technique("sparse_pruning", {"schedule_offset": 0, "method": "topk", "schedule_offset_end": 2},
                       {"dense_ratio": 0.5}, ["fc1"])
    scheduler = _start(two_layer, config)
    scores = two_layer.fc1.sparse_mask_scores
    two_layer(torch.randn(4, 16)).sum().backward()
    assert scores.grad is not None and scores.grad.abs().sum() > 0  # the straight-through gradient reaches them
    with torch.no_grad():
        scores.copy_(torch.arange(512.0).reshape(32, 16))  # now the last half of the weights rank highest
    out = two_layer.fc1(torch.eye(16))
    assert torch.equal(out[:, :16] - two_layer.fc1.bias[:16], torch.zeros(16, 16))  # rows 0-15 all pruned
    scheduler.step()
    scheduler.step()  # step 2 = schedule_offset_end: frozen
    frozen = two_layer.fc1.sparse_pruning_mask.clone()
    with torch.no_grad():
        scores.neg_()
    assert torch.equal(frozen, torch.arange(512).reshape(32, 16) >= 256)
    assert torch.equal(two_layer.fc1(torch.eye(16)), out)  # the scores no longer matter


def test_snip_momentum_prunes_to_the_schedule_by_weight_times_gradient(two_layer):
    config = {"compression_training": {"sparse_pruning": {"shared_parameters": {
        "enabled": True, "method": "snip_momentum", "schedule_offset": 0, "schedule_offset_end": 2,
        "schedule_offset_stride": 1, "block_pattern": "1x1", "dense_ratio": 0.25}}}}
    scheduler = _start(two_layer, config)
    x = torch.randn(8, 16)
    for _ in range(2):  # step 1: density 0.25 + 0.75 * 0.5^3; step 2 (schedule_offset_end): 0.25
        two_layer(x).pow(2).sum().backward()
        scheduler.step()
    fc1 = two_layer.fc1
    assert fc1.sparse_snip_scores.sum() > 0
    assert fc1.sparse_pruning_mask.sum().item() == keep_count(512, 0.25)
    assert torch.equal(fc1.sparse_pruning_mask, topk_mask(fc1.sparse_snip_scores, 0.25) > 0)
    assert fc1.ds_compression.prunings["sparse"].density == 0.25


@pytest.mark.parametrize("method", ["l1", "topk"])
def test_row_pruning_with_related_module_shrinks_and_keeps_outputs(two_layer, method):
    config = technique("row_pruning", {"schedule_offset": 0, "method": method}, {"dense_ratio": 0.25}, ["fc1"],
                       related=[["fc2"]])
    _start(two_layer, config)
    x = torch.randn(5, 16)
    masked = two_layer(x)
    redundancy_clean(two_layer, config)
    assert two_layer.fc1.weight.shape == (8, 16) and two_layer.fc2.weight.shape == (8, 8)
    assert two_layer.fc1.out_features == 8 and two_layer.fc2.in_features == 8
    pruned_before = 32 * 16 + 32 + 8 * 32  # fc1 weight and bias, fc2 weight
    pruned_after = 8 * 16 + 8 + 8 * 8
    assert sum(p.numel() for p in two_layer.parameters()) == pruned_after + 8  # + fc2's bias
    assert pruned_after == 0.25 * pruned_before
    assert torch.allclose(two_layer(x), masked, atol=1e-6)


def test_head_pruning_removes_heads_from_gpt_attention():
    torch.manual_seed(0)
    model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    config = technique("head_pruning", {"schedule_offset": 0, "num_heads": 4}, {"dense_ratio": 0.5},
                       ["attn.c_proj"], related=[["attn.c_attn"]])
    _start(model, config)
    model.eval()
    tokens = torch.randint(0, 64, (2, 16))
    masked = model(tokens)
    attn_before = sum(p.numel() for n, p in model.named_parameters() if ".attn." in n and "scores" not in n)
    redundancy_clean(model, config)
    attn = model.transformer.h[0].attn
    assert attn.n_head == 2 and attn.c_attn.weight.shape == (48, 32) and attn.c_proj.weight.shape == (32, 16)
    attn_after = sum(p.numel() for n, p in model.named_parameters() if ".attn." in n)
    removed = 2 * (3 * 16 * 32 + 3 * 16 + 32 * 16)  # per layer: Q/K/V rows and biases, output columns of 2 heads
    assert attn_before - attn_after == removed
    assert abs(removed / (attn_before - 2 * 32) - 0.5) < 0.01  # all but the output bias: (1 - dense_ratio)
    assert torch.allclose(model(tokens), masked, atol=1e-5)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        return self.conv2(torch.relu(self.bn1(self.conv1(x))))


@pytest.mark.parametrize("method", ["l1", "topk"])
def test_channel_pruning_with_batchnorm_agrees_before_and_after_clean(method):
    torch.manual_seed(0)
    net = ConvNet()
    config = technique("channel_pruning", {"schedule_offset": 0, "method": method}, {"dense_ratio": 0.5},
                       ["conv1"], related=[["conv2", "bn1"]])
    _start(net, config)
    x = torch.randn(2, 3, 6, 6)
    net.train()
    net(x)  # batch statistics, pruned channels included, as training would compute them
    net.eval()
    masked = net(x)
    redundancy_clean(net, config)
    assert net.conv1.weight.shape == (4, 3, 3, 3) and net.bn1.num_features == 4 and net.conv2.weight.shape == (4, 4, 3, 3)
    assert torch.allclose(net(x), masked, atol=1e-5)


def test_snip_momentum_group_dense_ratio_overrides_the_shared_target(two_layer):
    config = {"compression_training": {"sparse_pruning": {
        "shared_parameters": {"enabled": True, "method": "snip_momentum", "schedule_offset": 0,
                              "schedule_offset_end": 1, "schedule_offset_stride": 1, "block_pattern": "1x1",
                              "dense_ratio": 0.25},
        "different_groups": {"shared": {"params": {}, "modules": ["fc1"]},
                             "own": {"params": {"dense_ratio": 0.5}, "modules": ["fc2"]}}}}}
    scheduler = _start(two_layer, config)
    two_layer(torch.randn(8, 16)).pow(2).sum().backward()
    scheduler.step()
    assert two_layer.fc1.sparse_pruning_mask.float().mean() == 0.25
    assert two_layer.fc2.sparse_pruning_mask.float().mean() == 0.5
