"""DeepSpeed's gradient helpers of ``runtime.utils`` (``dsrun/tensor_parallel/megatron_grads.py``) in a one-rank
gloo world: the clip equals torch's where there is one rank, the overflow check sees an inf in an expert gradient,
the weight norm marks inf as -1, and the backward counter counts only the parameters the running backward
reaches."""
from __future__ import annotations

import math

import pytest
import torch

from dsrun.compat.runtime import utils as ds_utils
from dsrun.utils import groups

pytestmark = pytest.mark.usefixtures("world_of_one")


def _params(*grads: list[float]) -> list[torch.nn.Parameter]:
    params = []
    for grad in grads:
        p = torch.nn.Parameter(torch.zeros(len(grad)))
        p.grad = torch.tensor(grad)
        params.append(p)
    return params


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_grad_norm_matches_torch_on_one_rank(norm_type: float) -> None:
    expected, actual = _params([3.0, 4.0], [12.0]), _params([3.0, 4.0], [12.0])
    torch_norm = torch.nn.utils.clip_grad_norm_(expected, max_norm=1.0, norm_type=norm_type)
    norm = ds_utils.clip_grad_norm_(actual, max_norm=1.0, norm_type=norm_type)
    assert norm.item() == pytest.approx(13.0 if norm_type == 2 else 12.0)
    assert norm.item() == pytest.approx(torch_norm.item())
    for e, a in zip(expected, actual):
        # both scale by max_norm / (norm + 1e-6); float32 rounding of that factor only
        torch.testing.assert_close(a.grad, e.grad, rtol=2 ** -22, atol=0)
    small = _params([0.1])
    ds_utils.clip_grad_norm_(small, max_norm=1.0)
    assert small[0].grad.item() == pytest.approx(0.1)  # under the maximum: not scaled up


def test_weight_norm_and_overflow_of_expert_gradients() -> None:
    groups._reset()
    groups._create_expert_and_data_parallel(1)
    dense, expert = _params([1.0], [float("inf")])
    expert.allreduce = False  # DeepSpeed's mark of an expert parameter
    checker = ds_utils.CheckOverflow([[dense, expert]])
    assert checker.has_moe_params and checker.check()
    assert not ds_utils.CheckOverflow([[dense]]).check()
    flat = torch.cat([dense.grad, expert.grad])
    assert ds_utils.get_weight_norm([flat]) == -1
    assert checker.check_using_norm([ds_utils.get_weight_norm([flat])], reduce_overflow=False)
    assert ds_utils.get_weight_norm([torch.tensor([3.0, 4.0])]) == pytest.approx(5.0)
    groups._reset()


def test_count_used_parameters_in_backward() -> None:
    used, unused, frozen = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    frozen.requires_grad_(False)
    seen = {}

    def hook(grad: torch.Tensor) -> torch.Tensor:
        seen["count"] = ds_utils.count_used_parameters_in_backward([used, unused, frozen])
        return grad

    used.register_hook(hook)
    (used * frozen).sum().backward()
    assert seen["count"] == 1
    with pytest.raises(RuntimeError, match="during backward"):
        ds_utils.count_used_parameters_in_backward([used])
