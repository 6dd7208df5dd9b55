"""``seq_parallel_comm_data_type`` (DeepSpeed's "gradient communication data type for sequence parallelism"): with
``sequence_parallel_size`` > 1 the engine reduces gradients in that dtype instead of ``communication_data_type``,
fp32 by default even for a bf16 model, as DeepSpeed's engine does. Two gloo ranks with P = 2, ZeRO stage 0, plain
SGD with lr 1 so a step's parameter change is the reduced gradient: the reduction's bytes follow the key, and the
reduced gradient equals the mean of the two ranks' local gradients within the rounding of the dtype it travelled
in."""
from __future__ import annotations

import copy

import torch

from tests.helpers import run_ranks

CASES = {  # name -> (precision section, seq_parallel_comm_data_type or None for the default)
    "fp32": ({}, None),
    "fp32 over bf16": ({}, "bf16"),
    "bf16 model": ({"bf16": {"enabled": True}}, None),
    "bf16 model over bf16": ({"bf16": {"enabled": True}}, "bf16"),
}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def reduce_once(rank: int, world: int) -> dict:
    import torch.nn.functional as F

    import dsrun
    from dsrun import comm

    comm.init_distributed(dist_backend="gloo")
    try:
        gen = torch.Generator().manual_seed(10 + rank)  # each rank its own samples
        x, y = torch.randn(2, 16, generator=gen), torch.randn(2, 4, generator=gen)
        local = model()
        F.mse_loss(local(x), y).backward()
        out = {"local": torch.cat([p.grad.flatten() for p in local.parameters()]).double()}
        for name, (precision, comm_dtype) in CASES.items():
            net = copy.deepcopy(model())
            config = {"train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": 2, **precision,
                      "optimizer": {"type": "SGD", "params": {"lr": 1.0}}, "zero_allow_untested_optimizer": True,
                      "gradient_clipping": 0.0}  # the step is the mean gradient itself; one all-reduce, no norm
            if comm_dtype is not None:
                config["seq_parallel_comm_data_type"] = comm_dtype
            engine = dsrun.initialize(model=net, model_parameters=net.parameters(), config=config)[0]
            before = torch.cat([p.detach().double().flatten() for p in net.parameters()])
            comm.reset_comms_stats()
            engine.backward(F.mse_loss(engine(x.to(engine.precision.model_dtype)).float(), y))
            engine.step()
            stats = comm.get_comms_stats()
            after = torch.cat([p.detach().double().flatten() for p in net.parameters()])
            out[name] = {"dtype": str(engine.communication_data_type), "stats": stats, "before": before,
                         "after": after}
        return out
    finally:
        comm.destroy_process_group()


def test_seq_parallel_comm_data_type_sets_the_gradient_reduction_dtype():
    ranks = run_ranks(reduce_once, 2, timeout=240)
    first = ranks[0]
    elements = first["local"].numel()
    for name, (_, comm_dtype) in CASES.items():
        dtype, bytes_per_element = (("torch.bfloat16", 2) if comm_dtype == "bf16" else ("torch.float32", 4))
        assert first[name]["dtype"] == dtype, name  # fp32 unless the key says otherwise, a bf16 model too
        reduced = first[name]["stats"]["all_reduce"]  # one bucket: the whole gradient, in the key's dtype
        assert reduced["message_bytes"] == elements * bytes_per_element, (name, reduced)
    # fp32 training: the step moved each parameter by the reduced gradient; it is the mean of the two ranks'
    # local gradients up to the rounding of the dtype they travelled in (each rank's share rounded once to
    # it, the sum once more: 2 eps · the mean magnitude covers both) plus the fp32 rounding of the update
    mean = (ranks[0]["local"] + ranks[1]["local"]) / 2
    magnitude = (ranks[0]["local"].abs() + ranks[1]["local"].abs()) / 2
    steps = {}
    for name, travelled in (("fp32", torch.float32), ("fp32 over bf16", torch.bfloat16)):
        got = first[name]
        steps[name] = got["before"] - got["after"]
        bound = 2 * torch.finfo(travelled).eps * magnitude + torch.finfo(torch.float32).eps * got["after"].abs()
        assert ((steps[name] - mean).abs() <= bound).all(), name
        assert torch.equal(ranks[1][name]["after"], got["after"])  # every rank took the same step
    assert not torch.equal(steps["fp32"], steps["fp32 over bf16"])  # the bf16 trip did round
