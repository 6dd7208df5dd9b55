"""DeepSpeed's ZenFlow selective AdamW classes: torch's AdamW on the selected columns, nothing elsewhere, in both
layouts (stage 1-2 columns of the weight, stage 3 rows of the transposed partition) and with host moments."""
from __future__ import annotations

import pytest
import torch

from dsrun.ops.adam import ZenFlowSelectiveAdamW, ZenFlowSelectiveAdamW_stage3

COLUMNS = torch.tensor([0, 2, 3])
OPTIONS = dict(lr=0.01, weight_decay=0.1, amsgrad=True, betas=(0.8, 0.9))


def _reference(weight: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    """torch's AdamW on the selected columns alone."""
    columns = torch.nn.Parameter(weight[:, COLUMNS].clone())
    optimizer = torch.optim.AdamW([columns], **OPTIONS)
    for grad in grads:
        columns.grad = grad.clone()
        optimizer.step()
    out = weight.clone()
    out[:, COLUMNS] = columns.detach()
    return out


def _stage3_param(weight: torch.Tensor) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.empty(0))
    param.ds_shape = (weight.shape[1], weight.shape[0])  # the partition holds the weight transposed
    param.ds_tensor = torch.cat([torch.full((3, ), 7.0), weight.T.reshape(-1)])  # 3 elements of another parameter
    param.complete_column_offset, param.complete_numel, param.group_id = 3, weight.numel(), 0
    return param


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("layout", ["stage12", "stage3"])
def test_selected_columns_step_as_torch_adamw_and_the_rest_stays(layout: str, offload: bool):
    torch.manual_seed(0)
    weight = torch.randn(4, 5)
    grads = [torch.randn(4, 3) for _ in range(4)]
    if layout == "stage12":
        param, optimizer_class = torch.nn.Parameter(weight.clone()), ZenFlowSelectiveAdamW
    else:
        param, optimizer_class = _stage3_param(weight), ZenFlowSelectiveAdamW_stage3
    optimizer = optimizer_class([param], offload=offload, bucket_size=1, **OPTIONS)
    if offload:  # the moments live on the host between steps
        param.exp_avg_cpu_data, param.exp_avg_sq_cpu_data = torch.zeros(12), torch.zeros(12)
    for grad in grads:
        param.selected_indices = COLUMNS
        param.selected_grad = grad if layout == "stage12" else grad.T.contiguous()
        optimizer.step()
    result = param.data if layout == "stage12" else param.ds_tensor[3:].view(5, 4).T
    torch.testing.assert_close(result, _reference(weight, grads), rtol=0, atol=1e-6)  # a few fp32 ulps of ~1
    if layout == "stage3":
        assert torch.equal(param.ds_tensor[:3], torch.full((3, ), 7.0))  # the other parameter's elements
    assert int(optimizer.state[param]["step"]) == len(grads)
