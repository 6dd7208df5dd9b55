"""Stepping torch's Adam/AdamW over a flat ZeRO-3 master a chunk at a time gives the whole step's bits."""
import pytest
import torch

from dsrun.offload.chunked_step import can_chunk, chunked_step


def _optimizer(cls: type, numel: int, **kwargs) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    master = torch.nn.Parameter(torch.randn(numel))
    small = torch.nn.Parameter(torch.randn(7))  # under a chunk: stepped whole either way
    return cls([{"params": [master, small]}], lr=1e-2, weight_decay=0.1, **kwargs)


@pytest.mark.parametrize("cls,kwargs", [(torch.optim.AdamW, {}), (torch.optim.Adam, {"amsgrad": True})])
def test_a_chunked_step_is_bit_identical_to_the_whole_step(cls, kwargs) -> None:
    whole, chunked = _optimizer(cls, 10_007, **kwargs), _optimizer(cls, 10_007, **kwargs)
    for step in range(3):
        grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(step + i))
                 for i, p in enumerate(whole.param_groups[0]["params"])]
        for opt in (whole, chunked):
            for p, g in zip(opt.param_groups[0]["params"], grads):
                p.grad = g.clone()
        whole.step()
        assert can_chunk(chunked, chunk=1024) == (step > 0)  # the first step makes the state: whole
        chunked_step(chunked, chunk=1024)
        for a, b in zip(whole.param_groups[0]["params"], chunked.param_groups[0]["params"]):
            assert torch.equal(a, b)
            for key, value in whole.state[a].items():
                assert torch.equal(value, chunked.state[b][key]), key
    # the chunk views are gone: the optimizer holds and saves only its own parameters
    assert len(chunked.state) == 2 and len(chunked.param_groups[0]["params"]) == 2
    assert chunked.state_dict()["state"].keys() == whole.state_dict()["state"].keys()


def test_an_optimizer_that_is_not_elementwise_steps_whole() -> None:
    opt = _optimizer(torch.optim.Adagrad, 4096)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()
    assert not can_chunk(opt, chunk=1024)
