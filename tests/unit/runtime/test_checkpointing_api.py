"""``dsrun.checkpointing``: DeepSpeed's names and signatures, gradients bitwise equal to no checkpointing
(reentrant and non-reentrant; dropout, None, integer tensors, keyword arguments, tuple outputs, frozen
inputs), and the CPU-safe RNG tracker."""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dsrun
import dsrun.activation_checkpointing.api as ckpt
from dsrun.activation_checkpointing.settings import reset_configuration

FUNCTIONS = {"reentrant": ckpt.checkpoint, "non_reentrant": ckpt.non_reentrant_checkpoint,
             "selective": ckpt.selective_checkpoint}


@pytest.fixture(autouse=True)
def fresh_configuration():
    reset_configuration()
    yield
    reset_configuration()


@pytest.fixture
def cpu_accelerator(monkeypatch):
    """The tracker draws from the device generator: the host's on a CPU rank (also on a machine with a GPU)."""
    from dsrun.accelerator import real_accelerator
    from dsrun.accelerator.cpu_accelerator import CPU_Accelerator

    monkeypatch.setattr(real_accelerator, "ds_accelerator", CPU_Accelerator())


def test_deepspeed_names_and_signatures():
    assert dsrun.checkpointing is ckpt
    for name in ("configure", "is_configured", "checkpoint", "non_reentrant_checkpoint", "reset",
                 "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed", "CudaRNGStatesTracker",
                 "CheckpointFunction", "partition_activations_in_checkpoint", "set_num_layers"):
        assert hasattr(ckpt, name), name
    assert list(inspect.signature(ckpt.configure).parameters) == [
        "mpu_", "deepspeed_config", "partition_activations", "contiguous_checkpointing", "num_checkpoints",
        "checkpoint_in_cpu", "synchronize", "profile"]
    assert list(inspect.signature(ckpt.checkpoint).parameters)[:2] == ["function", "args"]
    assert list(inspect.signature(ckpt.model_parallel_cuda_manual_seed).parameters) == ["seed"]


class Awkward(nn.Module):
    """Takes a tensor, None, an integer tensor, a plain int and a keyword tensor; returns a tuple holding a
    tensor, an integer tensor, None and a dict; uses dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.emb = nn.Embedding(10, 8)

    def forward(self, x, nothing, ids, scale, *, bias=None):
        assert nothing is None and isinstance(scale, int)
        h = F.dropout(torch.tanh(self.lin(x)) + self.emb(ids), p=0.3, training=True) * scale
        if bias is not None:
            h = h + bias
        return h, ids + 1, None, {"sum": h.sum(dim=-1)}


def _grads_of(run):
    torch.manual_seed(0)
    module = Awkward()
    x = torch.randn(4, 8, requires_grad=True)
    bias = torch.randn(8, requires_grad=True)
    ids = torch.randint(0, 10, (4,))
    torch.manual_seed(7)  # the same dropout mask for every variant
    h, ids_out, nothing, extra = run(module, x, None, ids, 3, bias=bias)
    assert nothing is None and torch.equal(ids_out, ids + 1) and ids_out.dtype == torch.int64
    ((h ** 2).sum() + extra["sum"].sum()).backward()
    return [x.grad, bias.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_gradients_bitwise_equal_with_awkward_arguments_and_outputs(name):
    fn = FUNCTIONS[name]
    plain = _grads_of(lambda module, *args, **kwargs: module(*args, **kwargs))
    checkpointed = _grads_of(lambda module, *args, **kwargs: fn(module, *args, **kwargs))
    for a, b in zip(plain, checkpointed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_parameters_get_gradients_when_no_input_requires_grad(name):
    """A frozen embedding before the first checkpointed block: the block's parameters still learn."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 6))
    x = torch.randn(3, 6)  # no gradient wanted
    block(x).sum().backward()
    expected = [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    FUNCTIONS[name](block, x).sum().backward()
    for p, g in zip(block.parameters(), expected):
        assert torch.equal(p.grad, g)


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_no_graph_means_a_plain_call(name):
    calls = []

    def fn(x):
        calls.append(torch.is_grad_enabled())
        return x * 2

    with torch.no_grad():
        out = FUNCTIONS[name](fn, torch.ones(2, requires_grad=True))
    assert calls == [False] and out.grad_fn is None


def test_non_reentrant_recomputes_again_for_a_second_backward():
    torch.manual_seed(0)
    lin = nn.Linear(5, 5)
    x = torch.randn(2, 5, requires_grad=True)
    loss = ckpt.non_reentrant_checkpoint(lambda t: torch.sin(lin(t)), x).pow(2).sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    assert torch.equal(x.grad, 2 * first)


def test_a_function_that_changes_between_forward_and_recompute_is_named():
    state = {"calls": 0}

    def unstable(x):
        state["calls"] += 1
        return x.exp() if state["calls"] == 1 else x.exp().exp()

    y = ckpt.non_reentrant_checkpoint(unstable, torch.ones(3, requires_grad=True)).sum()
    with pytest.raises(RuntimeError, match="same operations"):
        y.backward()


def test_model_parallel_dropout_under_the_tracker_replays_in_the_recompute():
    ckpt.model_parallel_cuda_manual_seed(123)
    tracker = ckpt.get_cuda_rng_tracker()
    lin = nn.Linear(16, 16)

    def region(x):
        with tracker.fork():  # dropout in a model-parallel region draws from the tracked state
            return F.dropout(lin(x), p=0.5, training=True)

    x = torch.randn(4, 16, requires_grad=True)
    states = tracker.get_states()
    region(x).sum().backward()
    expected = x.grad.clone()
    for fn in (ckpt.checkpoint, ckpt.non_reentrant_checkpoint):
        tracker.set_states(states)
        x.grad = None
        fn(region, x).sum().backward()
        assert torch.equal(x.grad, expected)


def test_rng_tracker_on_cpu(cpu_accelerator):
    tracker = ckpt.CudaRNGStatesTracker()
    tracker.add("a", 5)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(3)
    with tracker.fork("a"):
        second = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched
    torch.manual_seed(5)
    assert torch.equal(torch.cat([first, second]), torch.rand(6))  # one stream, advanced across forks
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("b", 5)
    with pytest.raises(ValueError, match="not in the tracker"):
        with tracker.fork("missing"):
            pass


def test_model_parallel_seed_uses_the_model_parallel_rank(cpu_accelerator):
    class Mpu:
        def get_model_parallel_group(self):
            return None

        def get_model_parallel_rank(self):
            return 3

        def get_model_parallel_world_size(self):
            return 4

    ckpt.configure(Mpu())
    ckpt.model_parallel_cuda_manual_seed(10)
    default = torch.rand(2)
    with ckpt.get_cuda_rng_tracker().fork():
        tracked = torch.rand(2)
    torch.manual_seed(10)
    assert torch.equal(default, torch.rand(2))
    torch.manual_seed(10 + 2718 + 3)
    assert torch.equal(tracked, torch.rand(2))
