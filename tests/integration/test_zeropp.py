"""ZeRO++ at stage 3 on two gloo ranks (one launch) and the hierarchical quantized reduce-scatter on four (two
"nodes" of two). Bytes are the comms logger's exact message bytes; results are compared with plain-torch
simulations (tests/unit/comm/test_quantized.py). The engine runs are ``Case`` records (tests/harness/runs.py)
of the harness's ``zeropp_mlp``, each rank training on batches of its own (``rank_batch``)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from dsrun.comm import quantized as q
from dsrun.estimate.inputs import BufferSettings, EstimateInputs
from dsrun.estimate.model_states import model_state_bytes
from tests.harness.launch import Launch
from tests.harness.models import ZEROPP_HIDDEN as HIDDEN, ZEROPP_IN as IN, ZEROPP_OUT as OUT
from tests.harness.models import build_model, rank_batch
from tests.harness.runs import Case, ds_config
from tests.helpers import run_ranks
from tests.unit.comm.test_quantized import simulate_all_gather, simulate_reduce_scatter

WORLD, STEPS, MICRO = 2, 3, 2


def collective_inputs(world: int, seed: int, shard: int = 300, chunk: int = 700) -> tuple[list, list]:
    """Every rank's all-gather shard (fp32) and reduce-scatter rows ((world, chunk) fp32), the same in
    every process."""
    g = torch.Generator().manual_seed(seed)
    shards = [torch.randn(shard, generator=g) * (r + 1) for r in range(world)]
    rows = [torch.randn(world, chunk, generator=g) * torch.logspace(-2, 1, chunk) for _ in range(world)]
    return shards, rows


def collectives(rank: int, world: int, node_sizes: tuple[int, ...]) -> dict[str, Any]:
    """Rank entry point: the quantized all-gather (synchronous and asynchronous, into bf16 too) and the
    quantized reduce-scatter for each ``node_sizes`` entry (ranks per node)."""
    from dsrun import comm

    comm.init_distributed("gloo")
    shards, rows = collective_inputs(world, seed=7)
    out: dict[str, Any] = {}
    gathered = torch.empty(world * shards[0].numel())
    q.quantized_all_gather_into_tensor(gathered, shards[rank])
    out["gather"] = gathered
    gathered16 = torch.empty(world * shards[0].numel(), dtype=torch.bfloat16)
    q.quantized_all_gather_into_tensor(gathered16, shards[rank], async_op=True).wait()
    out["gather_bf16"] = gathered16
    for node in node_sizes:
        reducer = q.make_reduce_scatter(None, node_size=node)
        result = torch.empty(rows[0].shape[1])
        reducer(result, rows[rank])
        out[f"reduce/{node}"] = (result, reducer.hierarchical)
        out[f"loco/{node}"] = loco_sums(rows[rank], node)
    out["coalesced"] = coalesced(rank, world, min(node_sizes))
    return out


LOCO_STEPS = 8


def loco_sums(rows: torch.Tensor, node: int) -> dict[str, torch.Tensor]:
    """The sum of LOCO_STEPS reduce-scatters of the same ``rows``, plain qgZ and with LoCo's error feedback at
    err_beta 0 (each step sends the error the last one left)."""
    sums = {}
    for name, loco in (("plain", None), ("loco", q.LocoFeedback(err_beta=0.0, reset_T=1000))):
        reducer = q.make_reduce_scatter(None, node_size=node, loco=loco)
        total = torch.zeros(rows.shape[1])
        for _ in range(LOCO_STEPS):
            result = torch.empty(rows.shape[1])
            reducer(result, rows, ("bucket",), 1.0)
            total += result
        sums[name] = total
    return sums


def coalesced_inputs(world: int) -> tuple[list, torch.Tensor, list]:
    """reduce_scatter_coalesced's tensors (integers: every average is exact), all_to_all_quant_reduce's 2-D
    tensor (its size a multiple of 2 * world) and its two fallbacks, per rank."""
    g = torch.Generator().manual_seed(11)
    plain = [[torch.randint(-50, 50, shape, generator=g).float() for shape in ((7,), (2, 4), (1,))]
             for _ in range(world)]
    quant = [torch.randn(2 * world, 35, generator=g) for _ in range(world)]
    fallback = [[torch.randn(6, generator=g), torch.randn(7, 7, generator=g)] for _ in range(world)]
    return plain, quant, fallback


def coalesced(rank: int, world: int, node: int) -> dict[str, Any]:
    """DeepSpeed's coalesced reduce-scatters (dsrun/comm/coalesced.py), with ``node`` ranks per node."""
    import os

    from dsrun import comm
    from dsrun.comm.coalesced import all_to_all_loco_quant_reduce, all_to_all_quant_reduce, reduce_scatter_coalesced

    os.environ["LOCAL_SIZE"] = str(node)  # the accelerator's device_count: the ranks of a node
    plain, quant, fallback = coalesced_inputs(world)
    groups = {}
    for i in range(world // node):  # DeepSpeed's all2all groups, created in the same order on every rank
        groups[f"local_{i}"] = comm.new_group(list(range(i * node, (i + 1) * node)))
    for j in range(node):
        groups[f"global_{j}"] = comm.new_group(list(range(j, world, node)))
    single = torch.arange(4.0 * world) * (rank + 1)
    single_out = reduce_scatter_coalesced([single])[0]
    return {"plain": [t.clone() for t in reduce_scatter_coalesced([t.clone() for t in plain[rank]])],
            "single": single_out.clone(), "single_in_place": single_out.data_ptr() == single[4 * rank:].data_ptr(),
            "quant": all_to_all_quant_reduce([quant[rank].clone()], groups)[0],
            "loco": _loco_twice(all_to_all_loco_quant_reduce, quant[rank], groups),
            "fallback": [t.clone() for t in all_to_all_quant_reduce([t.clone() for t in fallback[rank]], groups)]}


def _loco_twice(reduce, tensor: torch.Tensor, groups: dict) -> list[torch.Tensor]:
    """DeepSpeed's all_to_all_loco_quant_reduce on one parameter whose gradient is ``tensor``, two steps."""
    param = torch.nn.Parameter(torch.zeros_like(tensor))
    param.grad = tensor.clone()
    return [reduce([param], groups, {"err_beta": 0.0, "reset_T": 10})[0].clone() for _ in range(2)]


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rank_batch("zeropp_mlp", step, rank, MICRO)


def config(bf16: bool = False, sequential: bool = False, **zero: Any) -> dict[str, Any]:
    """Stage 3 with nothing persistent and overlapped communication, DeepSpeed's default buckets, AdamW at
    1e-3 (its default weight decay), no clipping key; ``zero``: the ZeRO++ keys. ``sequential``: each parameter
    gathered on its own (the plain baselines, whose message sizes are the quantized gathers' units; quantized
    gathers are one per parameter either way)."""
    return ds_config(3, MICRO, 1, zero={"reduce_bucket_size": None, "allgather_bucket_size": None,
                                        "stage3_param_persistence_threshold": 0, "overlap_comm": True,
                                        "stage3_allgather_sequential": sequential, **zero},
                     optimizer={"type": "AdamW", "params": {"lr": 1e-3}}, gradient_clipping=None,
                     bf16={"enabled": bf16})


QWZ, QGZ = {"zero_quantized_weights": True}, {"zero_quantized_gradients": True}
CASES = [Case(key, model, cfg, worlds=(WORLD,), steps=STEPS) for key, model, cfg in (
    ("plain", "zeropp_mlp", config(sequential=True)),
    ("qwz", "zeropp_mlp", config(**QWZ)),
    ("qgz", "zeropp_mlp", config(**QGZ)),
    ("qgz_loco", "zeropp_mlp", config(**QGZ, zeropp_loco_param={"err_beta": 0.8, "reset_T": 1024})),
    ("both", "zeropp_mlp", config(**QWZ, **QGZ)),
    ("plain_bf16", "zeropp_mlp", config(bf16=True, sequential=True)),
    ("both_bf16", "zeropp_mlp", config(bf16=True, **QWZ, **QGZ)),
    ("frozen", "zeropp_mlp_frozen", config(sequential=True)),
    ("frozen_nontrainable", "zeropp_mlp_frozen", config(zero_quantized_nontrainable_weights=True)),
    ("frozen_dequantized", "zeropp_mlp_frozen", config()),  # plain, the frozen weights set to what the key keeps
)]
FROZEN_CASES = ("frozen", "frozen_nontrainable", "frozen_dequantized")


def kept_frozen_value(value: torch.Tensor, world: int) -> torch.Tensor:
    """What zero_quantized_nontrainable_weights keeps of a frozen weight: each rank's shard of the flat,
    zero-padded value quantized on its own (INT8, one scale per WEIGHT_BLOCK), decoded."""
    flat = value.detach().reshape(-1)
    part = -(-flat.numel() // world)
    padded = torch.cat([flat, flat.new_zeros(part * world - flat.numel())])
    shards = [q.dequantize(*q.quantize(padded[r * part:(r + 1) * part], 8, q.WEIGHT_BLOCK), q.WEIGHT_BLOCK)
              for r in range(world)]
    return torch.cat(shards)[:flat.numel()].view_as(value)


def _case_model(case: Case, world: int) -> torch.nn.Module:
    model = build_model(case.model)
    if case.key == "frozen_dequantized":
        with torch.no_grad():
            for p in model[0].parameters():
                p.copy_(kept_frozen_value(p, world))
    return model


def engines(rank: int, world: int) -> dict[str, Any]:
    """Rank entry point: the collectives, then per case the losses of its steps (this rank's own) and the
    comms logger's message bytes per (op, size)."""
    import dsrun
    from dsrun import comm

    out: dict[str, Any] = {"collectives": collectives(rank, world, (world, 1))}
    for case in CASES:
        name = case.key
        engine = dsrun.initialize(model=_case_model(case, world), config=case.config)[0]
        comm.reset_comms_stats()
        hidden: list[torch.Tensor] = []
        hook = engine.module[0].register_forward_hook(lambda m, i, o: hidden.append(o.detach().clone()))
        losses = _train(engine, rank, range(case.steps))
        hook.remove()
        sizes: dict[str, dict[int, int]] = {}
        for (op, size), stats in comm.comms_logger.by_size.items():
            sizes.setdefault(op, {})[size] = stats.count
        out[name] = {"losses": losses, "sizes": sizes}
        if name == "qwz":
            out[name]["exact"] = _gathers_exact_values(engine)
        if name in FROZEN_CASES:
            out[name].update(first_hidden=hidden[0], parameter_bytes=engine.memory_breakdown().parameters,
                             trainable=_full_values(engine.module[2]), frozen=_full_values(engine.module[0]))
        if name == "frozen_nontrainable":
            out[name]["resume"] = _resume(engine, rank, lambda case=case: _case_model(case, world), case.config)
    return out


def _train(engine: Any, rank: int, steps: Any) -> list[float]:
    import torch.nn.functional as F

    losses = []
    for step in steps:
        x, y = batch(step, rank)
        x, y = x.to(engine.module[0].weight.dtype), y.to(engine.module[0].weight.dtype)
        loss = F.mse_loss(engine(x).float(), y.float())
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _full_values(module: torch.nn.Module) -> list[torch.Tensor]:
    from dsrun.zero.partition_params import full_tensor

    return [full_tensor(p) for p in module.parameters()]


def _resume(engine: Any, rank: int, make_model: Any, config: dict) -> dict[str, Any]:
    """Save, train two more steps; a fresh engine whose weights were all halved loads the checkpoint and
    trains the same two steps: losses, weights and the kept INT8 messages, before and after."""
    import os
    import shutil
    import tempfile

    import dsrun
    from dsrun import comm
    from dsrun.zero import quantized_shards

    path = os.path.join(tempfile.gettempdir(), f"dsrun_zpp_resume_{os.environ['MASTER_PORT']}")
    messages = lambda e: [quantized_shards.message_of(p).clone() for p in e.module[0].parameters()]  # noqa: E731
    engine.save_checkpoint(path, tag="t")
    saved = messages(engine)
    losses = _train(engine, rank, range(STEPS, STEPS + 2))
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    fresh = dsrun.initialize(model=model, config=config)[0]
    changed = [not torch.equal(a, b) for a, b in zip(messages(fresh), saved)]
    fresh.load_checkpoint(path, tag="t")
    loaded = [torch.equal(a, b) for a, b in zip(messages(fresh), saved)]
    resumed = _train(fresh, rank, range(STEPS, STEPS + 2))
    comm.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return {"losses": losses, "resumed": resumed, "changed_before_load": changed, "loaded_exactly": loaded,
            "weights": _full_values(engine.module), "resumed_weights": _full_values(fresh.module)}


def _gathers_exact_values(engine: Any) -> bool:
    """Under qwZ, GatheredParameters (and so saving full weights) sees the exact shards, and writing a
    gathered value back (modifier_rank) leaves them as they were."""
    import dsrun
    from dsrun.utils import safe_get_full_fp32_param

    params = list(engine.module.parameters())
    before = [p.ds_tensor.clone() for p in params]
    with dsrun.zero.GatheredParameters(params, modifier_rank=0):
        full = [p.data.clone() for p in params]
    exact = all(torch.equal(f, safe_get_full_fp32_param(p)) for f, p in zip(full, params))
    return exact and all(torch.equal(b, p.ds_tensor) for b, p in zip(before, params))


LAUNCHES = {"engines": Launch(engines, WORLD, timeout=600)}


@pytest.fixture(scope="module")
def ranks(runs) -> list[dict]:
    return runs["engines"]


def _bytes(case: dict, op: str) -> int:
    return sum(size * count for size, count in case["sizes"].get(op, {}).items())


def _check_collectives(results: list[dict], world: int, node_sizes: tuple[int, ...]) -> None:
    shards, rows = collective_inputs(world, seed=7)
    gathered = simulate_all_gather(shards)
    for rank, out in enumerate(results):
        assert torch.equal(out["gather"], gathered)
        assert torch.equal(out["gather_bf16"], gathered.to(torch.bfloat16))
        for node in node_sizes:
            result, hierarchical = out[f"reduce/{node}"]
            assert hierarchical == (node < world)
            assert torch.equal(result, simulate_reduce_scatter(rows, node)[rank])
            # LoCo at err_beta 0: the sum of T steps' outputs telescopes to T * exact + (the error the last step
            # left, within half a quantization step) + the INT8 rounding of the stored errors (1/127 of that
            # per step), where plain qgZ repeats the same rounding T times: about 1/T + T/254 of its error
            exact = sum(r[rank] for r in rows) * LOCO_STEPS
            sums = out[f"loco/{node}"]
            loco_err, plain_err = (float((sums[k] - exact).abs().mean()) for k in ("loco", "plain"))
            assert loco_err <= (1 / LOCO_STEPS + LOCO_STEPS / 254 + 0.15) * plain_err, (node, loco_err, plain_err)
        _check_coalesced(out["coalesced"], rank, world, min(node_sizes))


def _check_coalesced(out: dict, rank: int, world: int, node: int) -> None:
    plain, quant, fallback = coalesced_inputs(world)
    for got, parts in zip(out["plain"], zip(*plain)):
        mean = (sum(p / world for p in parts)).reshape(-1)  # pre-divided integers: exact in any order
        size = -(-mean.numel() // world)
        assert torch.equal(got, mean[rank * size:(rank + 1) * size])  # the last ranks' parts shorter or empty
    assert torch.equal(out["single"], (torch.arange(4.0 * world) * sum(range(1, world + 1)) / world)[4 * rank:][:4])
    assert out["single_in_place"]  # one tensor that the world divides: divided in place, the output a view of it
    rows = [t.reshape(world, -1) for t in quant]
    block = quant[0].numel() // max(2 * world, 35, world)  # DeepSpeed's group count per tensor
    assert torch.equal(out["quant"], simulate_reduce_scatter(rows, node, bits=4, block=block)[rank] / world)
    first, second = out["loco"]  # LoCo: the first step has no error to send, the second sends the first's
    assert torch.equal(first, out["quant"]) and not torch.equal(second, first)
    exact = sum(r[rank] for r in rows) / world
    # two steps: 2 * exact - (the second's error) against plain's 2 * (the same rounding): about half of it
    assert float((first + second - 2 * exact).abs().mean()) <= 0.75 * float((2 * first - 2 * exact).abs().mean())
    for got, parts in zip(out["fallback"], zip(*fallback)):  # 1-D, and 49 elements: not a multiple of 2 * world
        mean = sum(p.reshape(-1) / world for p in parts)
        size = -(-mean.numel() // world)
        torch.testing.assert_close(got, mean[rank * size:(rank + 1) * size], rtol=0,
                                   atol=4 * world * torch.finfo(torch.float32).eps * float(mean.abs().max()))


def test_collectives_equal_the_plain_torch_simulation(ranks: list[dict]) -> None:
    _check_collectives([r["collectives"] for r in ranks], WORLD, (WORLD, 1))


def test_hierarchical_reduce_scatter_on_two_nodes_of_two() -> None:
    _check_collectives(run_ranks(collectives, 4, (4, 2), timeout=300), 4, (4, 2))


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

    model = build_model("zeropp_mlp")
    x, y = batch(0, rank)
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


def test_loco_feeds_the_quantization_error_back(ranks: list[dict]) -> None:
    """zeropp_loco_param: the same messages as qgZ (LoCo changes what is quantized, not how much), the same
    first forward, then other updates (the second step's gradients carry the first one's error); and close
    to plain ZeRO-3. The error feedback's arithmetic is test_collectives_equal_the_plain_torch_simulation's."""
    for rank in ranks:
        loco, qgz, plain = rank["qgz_loco"], rank["qgz"], rank["plain"]
        assert loco["sizes"] == qgz["sizes"]
        assert loco["losses"][:2] == qgz["losses"][:2]  # step 1's update has no error to feed back yet
        assert loco["losses"][2:] != qgz["losses"][2:]
        for a, b in zip(loco["losses"], plain["losses"]):
            assert abs(a - b) <= 0.02 * abs(b)


def test_nontrainable_weights_gather_quantized(ranks: list[dict]) -> None:
    """zero_quantized_nontrainable_weights: the frozen Linear's gathers are INT8, the trainable ones exact."""
    frozen_sizes = {WORLD * -(-n // WORLD) * 4 for n in (IN * HIDDEN, HIDDEN)}  # the first Linear's
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
    frozen_parts = [-(-n // WORLD) for n in (IN * HIDDEN, HIDDEN)]
    trainable_parts = [-(-n // WORLD) for n in (HIDDEN * OUT, OUT)]
    for rank in ranks:
        kept = sum(q.message_bytes(part, 8, q.WEIGHT_BLOCK) for part in frozen_parts)
        assert rank["frozen"]["parameter_bytes"] == 4 * (sum(frozen_parts) + sum(trainable_parts))
        assert rank["frozen_nontrainable"]["parameter_bytes"] == kept + 4 * sum(trainable_parts)
        assert kept <= 0.26 * 4 * sum(frozen_parts)
        # the estimator's count for this model: here the per-parameter blocks add up to the flat count
        spec = EstimateInputs(total_params=IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT,
                              trainable_params=HIDDEN * OUT + OUT, largest_layer_params=IN * HIDDEN,
                              ranks_per_node=WORLD, zero_stage=3, precision="fp32", small_params=0,
                              buffers=BufferSettings(zero_quantized_nontrainable_weights=True))
        assert model_state_bytes(spec).device_params == rank["frozen_nontrainable"]["parameter_bytes"]


def test_nontrainable_weights_compute_with_the_kept_values(ranks: list[dict]) -> None:
    """The frozen Linear computes with the dequantized weights: its first output is within the quantization
    step's bound of the exact one (each weight within scale / 2), equal bit for bit to a plain run whose
    frozen weights were set to the kept values; the trainable weights and losses of that run are equal
    bit for bit too (the key changes nothing but the frozen values)."""
    layer = build_model("zeropp_mlp_frozen")[0]
    weight_scale, bias_scale = _frozen_layer_scales(layer.weight), _frozen_layer_scales(layer.bias)
    eps = torch.finfo(torch.float32).eps
    for r, rank in enumerate(ranks):
        kept, plain, reference = rank["frozen_nontrainable"], rank["frozen"], rank["frozen_dequantized"]
        x = batch(0, r)[0].double()
        exact = x @ layer.weight.double().T + layer.bias.double()
        quant_bound = x.abs() @ (weight_scale.double() / 2).T + bias_scale.double() / 2
        # fp32 rounding of the two products of IN terms (gamma_n bound, twice: both runs round)
        rounding = 2 * (IN + 1) * eps * (x.abs() @ layer.weight.double().abs().T + layer.bias.double().abs())
        assert torch.all((plain["first_hidden"].double() - exact).abs() <= rounding / 2)
        assert torch.all((kept["first_hidden"].double() - exact).abs() <= quant_bound + rounding)
        assert not torch.equal(kept["first_hidden"], plain["first_hidden"])
        assert torch.equal(kept["first_hidden"], reference["first_hidden"])
        assert kept["losses"] == reference["losses"]
        for a, b in zip(kept["trainable"] + kept["frozen"], reference["trainable"] + reference["frozen"]):
            assert torch.equal(a, b)
        for value, original in zip(kept["frozen"], layer.parameters()):
            assert torch.equal(value, kept_frozen_value(original, WORLD))


def test_nontrainable_weights_resume_exactly(ranks: list[dict]) -> None:
    """A checkpoint keeps the frozen shards as held (INT8 messages besides the full-precision fragments):
    a fresh engine with other weights loads them byte for byte and trains on as the saved one did."""
    for rank in ranks:
        resume = rank["frozen_nontrainable"]["resume"]
        assert all(resume["changed_before_load"]) and all(resume["loaded_exactly"])
        assert resume["resumed"] == resume["losses"]
        for a, b in zip(resume["weights"], resume["resumed_weights"]):
            assert torch.equal(a, b)
