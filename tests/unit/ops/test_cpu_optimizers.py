"""DeepSpeedCPUAdam / Adagrad / Lion against their torch references after 100 steps on random data."""
from __future__ import annotations

import math

import pytest
import torch

from dsrun.ops.adagrad import DeepSpeedCPUAdagrad
from dsrun.ops.adam import DeepSpeedCPUAdam
from dsrun.ops.lion import DeepSpeedCPULion
from tests.tolerance import elementwise_bound

LENGTHS = [1, 7, 1023, 1_000_003]
STEPS = 100


class ReferenceLion(torch.optim.Optimizer):
    """Lion as published (Chen et al., 2023), written with plain torch ops."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = m.mul(beta1).add_(p.grad.mul(1 - beta1))
                p.sub_(update.sign_().mul_(group["lr"]))
                m.mul_(beta2).add_(p.grad.mul(1 - beta2))


# name -> (ours, torch reference), both taking a list of param groups
OPTIMIZERS = {
    "adamw": (lambda g: DeepSpeedCPUAdam(g, lr=1e-2, weight_decay=0.1),
              lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.1)),
    "adam_l2": (lambda g: DeepSpeedCPUAdam(g, lr=1e-2, weight_decay=0.1, adamw_mode=False),
                lambda g: torch.optim.Adam(g, lr=1e-2, weight_decay=0.1)),
    "adam_no_bias_correction": (lambda g: DeepSpeedCPUAdam(g, lr=1e-3, bias_correction=False),
                                None),
    "adagrad": (lambda g: DeepSpeedCPUAdagrad(g, lr=1e-2, weight_decay=0.1),
                lambda g: torch.optim.Adagrad(g, lr=1e-2, weight_decay=0.1, eps=1e-10)),
    "lion": (lambda g: DeepSpeedCPULion(g, lr=1e-3, weight_decay=0.1), lambda g: ReferenceLion(g, lr=1e-3,
                                                                                                weight_decay=0.1)),
}


class NoBiasCorrectionAdamW(torch.optim.Optimizer):
    """AdamW without bias correction, from torch ops (torch has no such switch)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                st = self.state[p]
                m = st.setdefault("m", torch.zeros_like(p))
                v = st.setdefault("v", torch.zeros_like(p))
                m.lerp_(p.grad, 1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                p.addcdiv_(m, v.sqrt().add_(group["eps"]), value=-group["lr"])


OPTIMIZERS["adam_no_bias_correction"] = (OPTIMIZERS["adam_no_bias_correction"][0],
                                         lambda g: NoBiasCorrectionAdamW(g, lr=1e-3))


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|: elementwise ratios blow up at entries that cross zero."""
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def run_both(name: str, shapes: list[list[int]], group_options: list[dict], steps: int = STEPS,
             dtype: torch.dtype = torch.float32):
    """Step ours and the reference on the same random gradients; returns (our params, ref params, ours)."""
    make_ours, make_ref = OPTIMIZERS[name]
    gen = torch.Generator().manual_seed(1234)
    inits = [[torch.randn(n, generator=gen).to(dtype) for n in group] for group in shapes]
    ours_params = [[torch.nn.Parameter(t.clone()) for t in g] for g in inits]
    ref_params = [[torch.nn.Parameter(t.clone().float()) for t in g] for g in inits]
    ours = make_ours([{"params": ps, **opt} for ps, opt in zip(ours_params, group_options)])
    ref = make_ref([{"params": ps, **opt} for ps, opt in zip(ref_params, group_options)])
    for _ in range(steps):
        for og, rg in zip(ours_params, ref_params):
            for o, r in zip(og, rg):
                g = torch.randn(o.shape, generator=gen).to(dtype)
                o.grad = g
                r.grad = g.float()
        ours.step()
        ref.step()
    return [p for g in ours_params for p in g], [p for g in ref_params for p in g], ours


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("length", LENGTHS)
def test_fp32_matches_torch_reference(name: str, length: int):
    ours, ref, opt = run_both(name, [[length]], [{}])
    assert opt.uses_compiled_op
    assert relative_error(ours[0].data, ref[0].data) <= elementwise_bound(STEPS)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_several_param_groups_with_their_own_hyper_parameters(name: str):
    options = [{"lr": 3e-3}, {"lr": 1e-2, "weight_decay": 0.0}, {}]
    ours, ref, _ = run_both(name, [[1, 7], [1023], [4099, 33]], options)
    # relative to the whole model: a 1-element tensor that decays towards zero has no scale of its own
    assert relative_error(torch.cat([o.data for o in ours]), torch.cat([r.data for r in ref])) <= elementwise_bound(STEPS)


@pytest.mark.parametrize("name", ["adamw", "lion"])
def test_all_threads_split_a_large_tensor_correctly(name: str):
    # The suite runs single-threaded (conftest); this exercises the OpenMP split and per-chunk tails.
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ours, ref, _ = run_both(name, [[1_000_003]], [{}], steps=10)
    finally:
        torch.set_num_threads(before)
    assert relative_error(ours[0].data, ref[0].data) <= elementwise_bound(10)


@pytest.mark.parametrize("name", ["adamw", "adagrad", "lion"])
def test_one_parallel_region_splits_many_tensors_of_any_length(name: str):
    # All tensors of a step share one parallel region; thread ranges cross tensor boundaries and are cut at
    # multiples of 1024 elements of a tensor, so tiny tensors, tails and cuts inside a tensor all occur.
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        shapes = [[1, 7, 1023, 40_961, 3], [70_001, 5, 1024]]
        ours, ref, _ = run_both(name, shapes, [{}, {"lr": 3e-3}], steps=10)
    finally:
        torch.set_num_threads(before)
    for o, r in zip(ours, ref):
        assert relative_error(o.data, r.data) <= elementwise_bound(10)


def test_huge_page_states_are_2mib_aligned_when_asked_for(monkeypatch):
    monkeypatch.setenv("DSRUN_OPTIM_HUGE_PAGES", "1")
    n = 1 << 20  # 4 MiB of fp32
    p = torch.nn.Parameter(torch.randn(n).bfloat16())
    p.grad = torch.randn(n).bfloat16()
    opt = DeepSpeedCPUAdam([p], lr=1e-3)
    opt.step()
    state = opt.state[p]
    for key in ("exp_avg", "exp_avg_sq", "master_param"):
        assert state[key].dtype == torch.float32 and state[key].data_ptr() % (2 << 20) == 0, key
    assert torch.equal(p.data, state["master_param"].to(torch.bfloat16))
    # a checkpoint restores into the same kind of memory, values unchanged
    resumed = DeepSpeedCPUAdam([torch.nn.Parameter(p.detach().clone())], lr=1e-3)
    resumed.load_state_dict(opt.state_dict())
    restored = next(iter(resumed.state.values()))
    assert restored["exp_avg_sq"].data_ptr() % (2 << 20) == 0
    assert torch.equal(restored["exp_avg_sq"], state["exp_avg_sq"])
    # by default states are torch tensors; new states start at zero either way
    monkeypatch.delenv("DSRUN_OPTIM_HUGE_PAGES")
    q = torch.nn.Parameter(torch.randn(n))
    plain = DeepSpeedCPUAdam([q])
    state = plain._init_state(q)
    assert not state["exp_avg"].any() and state["exp_avg"].dtype == torch.float32
    fresh = opt.op.empty_state([3, n], torch.bfloat16)
    assert fresh.shape == (3, n) and fresh.dtype == torch.bfloat16 and not fresh.any()
    assert fresh.data_ptr() % (2 << 20) == 0
    assert opt.op.empty_state([5], torch.float32).shape == (5,)


@pytest.mark.parametrize("name", ["adamw", "adagrad", "lion"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_params_keep_fp32_master_and_write_the_rounded_copy(name: str, dtype: torch.dtype):
    ours, ref, opt = run_both(name, [[1023, 70_001]], [{}], dtype=dtype)
    for p, r in zip(ours, ref):
        state = opt.state[p]
        master = state["master_param"]
        assert master.dtype == torch.float32 and p.dtype == dtype
        assert all(state[k].dtype == torch.float32 for k in opt.STATE_KEYS)
        # the master follows the fp32 reference given the same (16-bit) gradients ...
        assert relative_error(master, r.data) <= elementwise_bound(STEPS)
        # ... and the parameter is exactly the master rounded to 16 bits, written in the same pass
        assert torch.equal(p.data, master.to(dtype))
        assert relative_error(p.data.float(), r.data) <= 2 ** -8


def adamw_with_16bit_storage(p, g, m, v, step, lr=1e-2, wd=0.1, betas=(0.9, 0.999), eps=1e-8):
    """One AdamW step computed in fp32 from 16-bit (or fp32) storage and rounded back, in plain torch."""
    p32, m32, v32, g32 = p.float(), m.float(), v.float(), g.float()
    p32.mul_(1 - lr * wd)
    m32.lerp_(g32, 1 - betas[0])
    v32.mul_(betas[1]).addcmul_(g32, g32, value=1 - betas[1])
    denom = v32.sqrt().div_(math.sqrt(1 - betas[1] ** step)).add_(eps)
    p32.addcdiv_(m32, denom, value=-lr / (1 - betas[0] ** step))
    for storage, value in ((p, p32), (m, m32), (v, v32)):
        storage.copy_(value)


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_fp32_optimizer_states_false_keeps_bf16_states(param_dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    n = 4097
    p = torch.nn.Parameter(torch.randn(n, generator=gen).to(param_dtype))
    ref_p = p.detach().clone()
    ref_m, ref_v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    opt = DeepSpeedCPUAdam([p], lr=1e-2, weight_decay=0.1, fp32_optimizer_states=False)
    for step in range(1, 21):
        g = torch.randn(n, generator=gen).to(param_dtype)
        p.grad = g
        opt.step()
        adamw_with_16bit_storage(ref_p, g, ref_m, ref_v, step)
    state = opt.state[p]
    # as in DeepSpeed: 16-bit states, and a 16-bit parameter is updated directly (no fp32 master)
    assert "master_param" not in state and p.dtype == param_dtype
    assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg_sq"].dtype == torch.bfloat16
    # same values as rounding to bf16 after each fp32 step, up to rare rounding-boundary ties
    if param_dtype == torch.bfloat16:
        assert (p.data != ref_p).float().mean().item() < 0.01
        assert relative_error(p.data.float(), ref_p.float()) <= 2 ** -7
    else:
        assert relative_error(p.data, ref_p) <= 1e-5
    assert relative_error(state["exp_avg"].float(), ref_m.float()) <= 2 ** -6


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_torch_fallback_matches_the_kernel(name: str):
    shapes, options = [[7, 1023]], [{}]
    ours, ref, opt = run_both(name, shapes, options, steps=5)
    make_ours = OPTIMIZERS[name][0]
    gen = torch.Generator().manual_seed(1234)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in shapes[0]]
    fallback = make_ours([{"params": params}])
    fallback.op = None  # what a machine without a compiler runs
    for _ in range(5):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        fallback.step()
    for a, b in zip(params, ref):
        assert relative_error(a.data, b.data) <= elementwise_bound(5)


def test_state_dict_round_trip_keeps_fp32_master_and_resumes_identically():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(333).bfloat16())
    opt = DeepSpeedCPUAdam([p], lr=1e-2)
    grads = [torch.randn(333).bfloat16() for _ in range(6)]
    for g in grads[:3]:
        p.grad = g
        opt.step()
    saved = opt.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    resumed = DeepSpeedCPUAdam([q], lr=1e-2)
    resumed.load_state_dict(saved)
    assert resumed.state[q]["master_param"].dtype == torch.float32
    assert resumed.state[q]["step"] == 3
    for g in grads[3:]:
        p.grad, q.grad = g, g.clone()
        opt.step()
        resumed.step()
    assert torch.equal(opt.state[p]["master_param"], resumed.state[q]["master_param"])
    assert torch.equal(p.data, q.data)


def test_step_runs_the_closure_and_skips_params_without_grad():
    a, b = torch.nn.Parameter(torch.ones(5)), torch.nn.Parameter(torch.ones(5))
    opt = DeepSpeedCPUAdam([a, b], lr=0.1)
    a.grad = torch.ones(5)
    assert opt.step(lambda: 3.5) == 3.5
    assert not torch.equal(a.data, torch.ones(5))
    assert torch.equal(b.data, torch.ones(5)) and b not in opt.state
    assert isinstance(opt, torch.optim.Optimizer) and opt.param_groups[0]["lr"] == 0.1


def test_unsupported_options_are_rejected_clearly():
    with pytest.raises(ValueError, match="amsgrad"):
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.ones(1))], amsgrad=True)
    with pytest.raises(ValueError, match="betas"):
        DeepSpeedCPULion([torch.nn.Parameter(torch.ones(1))], betas=(1.5, 0.9))


def test_deepcopy_and_pickle_keep_settings_and_the_op():
    import copy
    import pickle

    p = torch.nn.Parameter(torch.ones(3).bfloat16())
    opt = DeepSpeedCPUAdam([p], lr=0.1, adamw_mode=False, fp32_optimizer_states=False)
    p.grad = torch.ones(3).bfloat16()
    opt.step()
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert clone.uses_compiled_op and clone.adamw_mode is False and clone.fp32_optimizer_states is False
        assert clone.param_groups[0]["lr"] == 0.1
