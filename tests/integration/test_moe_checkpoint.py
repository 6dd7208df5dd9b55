"""MoE checkpoints reshard between expert-parallel sizes and ZeRO stages: save with ep=2 on 2 ranks (ZeRO 0, 2
and 3), load with ep=1 on 1 rank (every expert on it) and save again, load that with ep=2; stage 3 loads into
stage 2 and stage 2 into stage 3: every expert's weights and Adam moments are bit-identical to what was saved,
and the next step's loss equals the uninterrupted run's (to fp32 rounding: the one-rank run accumulates the
two shards' gradients in another order).

The nets are the harness's ``moe_net/ep<E>`` (tests/harness/models.py) and, in a pipeline, its ``moe/ep<E>``
(tests/harness/pipeline.py); configs through ``ds_config``. Three launches (``collect``): every 2-rank run (the
saves, same-topology resumes, weights-only loads, the pipeline, offload), then the loads on 1 rank, then back
on 2; each test's checkpoints in a folder of its own."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.harness import pipeline as pw
from tests.harness.launch import Launch, Runs
from tests.harness.models import MOE_EXPERTS as EXPERTS, MOE_TOKENS as TOKENS, build_model, moe_shard
from tests.harness.runs import ds_config, full_moe_params
from tests.tolerance import fp32_sum_bound as fp32_bound

# multi-process launches (tens of seconds each on a loaded 2-core machine): slow, as the engine parity tests
pytestmark = pytest.mark.slow

ADAM = {"type": "Adam", "params": {"lr": 1e-2}}


def moe_config(stage: int, gas: int, zero: dict | None = None, **extra: Any) -> dict[str, Any]:
    """Adam at 1e-2, ZeRO ``stage`` with DeepSpeed's default buckets and clipping; ``zero``: more ZeRO keys
    (a None: left out)."""
    return ds_config(stage, TOKENS, gas, zero={"reduce_bucket_size": None, "allgather_bucket_size": None,
                                               **(zero or {})}, optimizer=ADAM, gradient_clipping=None, **extra)


def ckpt_engine(world: int, stage: int = 0) -> Any:
    import dsrun

    dsrun.init_distributed()
    engine, _, _, _ = dsrun.initialize(model=build_model(f"moe_net/ep{world}"), config=moe_config(stage, 2 // world))
    return engine


def ckpt_step(engine: Any, rank: int, world: int, step: int) -> float:
    """One optimizer step on the two shards of step ``step`` (2 ranks: one each; 1 rank: both, accumulated);
    returns the mean loss."""
    from dsrun import comm

    total = torch.zeros(1, dtype=torch.float64)
    for shard in range(rank, 2, world):
        x, y = moe_shard(shard)
        loss = engine((x + step, y))
        engine.backward(loss)
        engine.step()
        total += loss.item()
    if world > 1:
        comm.all_reduce(total)
    return float(total) / 2


def expert_state(engine: Any) -> dict[str, Any]:
    """Every expert parameter of this rank by global name: weight and Adam moments, whole (any stage;
    collective within each expert-data group)."""
    from dsrun.checkpoint import experts

    return {name: {key: state[key].float().numpy() for key in ("weight", "exp_avg", "exp_avg_sq")}
            for name, state in experts.expert_states(engine).items()}


def ckpt_save_first(rank: int, world: int, root: str) -> dict[str, Any]:
    """At ZeRO 0, 2 and 3 with ep=2: two steps, save (tags a, z2, z3), a third step; every expert's state
    when saved and the third step's loss."""
    out: dict[str, Any] = {}
    for stage, tag in ((0, "a"), (2, "z2"), (3, "z3")):
        engine = ckpt_engine(world, stage)
        for step in range(2):
            ckpt_step(engine, rank, world, step)
        engine.save_checkpoint(root, tag=tag)
        shared = {n: engine.strategy.full_param_value(p).numpy() for n, p in engine.module.named_parameters()
                  if ".deepspeed_experts." not in n}
        out[tag] = {"experts": expert_state(engine), "shared": shared, "next_loss": ckpt_step(engine, rank, world, 2)}
        engine.destroy()
    return out


def share_bytes(engine: Any) -> int:
    """The bytes of this rank's own optimizer state: the elements of each master tensor it holds (cut over the
    ranks that master is partitioned over, padding left out) x (fp32 master + Adam's two fp32 moments)."""
    from dsrun.utils.zero_to_fp32 import master_slots

    strategy = engine.strategy
    shapes = strategy.checkpoint_param_shapes()
    return 12 * sum(slot.length for mi, (world, rank, _) in enumerate(strategy.master_partitions())
                    for group in master_slots(strategy.stage, world, rank, [shapes[mi]])[0] for slot in group)


def ckpt_load(rank: int, world: int, root: str, loads: list[tuple[str, int, str | None]]) -> dict[str, Any]:
    """Rank entry point: for each (tag, stage, save_tag), an ep=world engine at ``stage`` loads ``tag`` (saving
    it again as ``save_tag``), then takes the third step: its experts when loaded, shared weights, loss, step
    count, the optimizer bytes the load read by range against the rank's share, and the module's bytes read into
    the live module against its size (ZeRO 0-2)."""
    from dsrun.checkpoint import tensor_file

    out = {}
    for tag, stage, save_tag in loads:
        engine = ckpt_engine(world, stage)
        stats = tensor_file.reset_read_stats()
        engine.load_checkpoint(root, tag=tag)
        read = (stats.range_bytes, share_bytes(engine))
        live = {t.data_ptr(): t.numel() * t.element_size() for t in engine.module.state_dict().values()}
        module_read = (stats.module_bytes, sum(live.values()) if stage < 3 else 0)  # ZeRO-3: through the masters
        loaded = expert_state(engine)
        shared = {n: engine.strategy.full_param_value(p).numpy() for n, p in engine.module.named_parameters()
                  if ".deepspeed_experts." not in n}
        if save_tag is not None:
            engine.save_checkpoint(root, tag=save_tag)
        next_loss = ckpt_step(engine, rank, world, 2)
        out[f"{tag}->zero{stage}"] = {"experts": loaded, "shared": shared, "next_loss": next_loss,
                                      "global_steps": engine.global_steps, "read": read, "module_read": module_read}
        engine.destroy()
    return out


def resume_same_topology(rank: int, world: int, root: str) -> dict[str, float]:
    """At ZeRO 1, 2 and 3: train 2 steps, save, take a third; a fresh engine loads and takes the third step
    again: the same loss, bit for bit (each rank reads its own files back); and ZeRO-2 loaded with the expert
    groups laid out data-first, which goes through the expert files."""
    import dsrun

    dsrun.init_distributed()
    out = {}
    for stage in (1, 2, 3):
        cfg = moe_config(stage, 1, {"stage3_param_persistence_threshold": 0})
        engine, _, _, _ = dsrun.initialize(model=build_model(f"moe_net/ep{world}"), config=cfg)
        for step in range(2):
            ckpt_step(engine, rank, world, step)
        engine.save_checkpoint(root, tag=f"s{stage}")
        first = ckpt_step(engine, rank, world, 2)
        engine.destroy()
        engine, _, _, _ = dsrun.initialize(model=build_model(f"moe_net/ep{world}"), config=cfg)
        with _counting_expert_loads() as routed:
            engine.load_checkpoint(root, tag=f"s{stage}")
        out[f"s{stage}"] = (first, ckpt_step(engine, rank, world, 2))
        out[f"s{stage}/routed"] = routed[0]
        engine.destroy()
    # ZeRO-2 loaded with the expert groups laid out data-first: the own-file shortcut would give a rank another
    # rank's experts (with 4+ ranks), so the load goes by global id through the expert files
    engine, _, _, _ = dsrun.initialize(model=build_model(f"moe_net/ep{world}"),
                                       config=moe_config(2, 1, use_data_before_expert_parallelism=True))
    with _counting_expert_loads() as routed:
        engine.load_checkpoint(root, tag="s2")
    out["s2/data_first"] = (out["s2"][0], ckpt_step(engine, rank, world, 2))
    out["s2/data_first/routed"] = routed[0]
    engine.destroy()
    return out


class _counting_expert_loads:
    """Counts the loads that place experts by global id from their files (``experts.optimizer_state``)."""

    def __enter__(self) -> list[int]:
        from dsrun.checkpoint import experts

        self.count, self.original = [0], experts.optimizer_state

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count[0] += 1
            return self.original(*args, **kwargs)

        experts.optimizer_state = counted
        return self.count

    def __exit__(self, *exc: Any) -> None:
        from dsrun.checkpoint import experts

        experts.optimizer_state = self.original


def load_weights_only(rank: int, world: int, root: str) -> dict[str, Any]:
    """At ZeRO 0, 2 and 3: train a step, save; a fresh engine loads with ``load_optimizer_states=False`` and
    another with ``load_module_only=True``: the module holds the saved weights, the fp32 masters equal them
    (every slot of every group, experts included), and the optimizer state is the fresh engine's (empty)."""
    from dsrun.checkpoint import experts
    from dsrun.utils import zero_to_fp32 as z2f  # the whole fp32 state dict, experts by global id

    out: dict[str, Any] = {}
    for stage in (0, 2, 3):
        engine = ckpt_engine(world, stage)
        ckpt_step(engine, rank, world, 0)
        engine.save_checkpoint(root, tag=f"w{stage}")
        saved = full_moe_params(engine)
        engine.destroy()
        whole = z2f.get_fp32_state_dict_from_zero_checkpoint(root, f"w{stage}")
        out[f"zero{stage}/zero_to_fp32"] = {"weights": max(float((whole[k] - saved[k]).abs().max()) for k in saved),
                                            "masters": 0.0,
                                            # this rank's experts and the shared weights, plus the other rank's
                                            "same_names": set(saved) <= set(whole) and len(whole) == len(
                                                [k for k in saved if ".deepspeed_experts." not in k]) + 4 * EXPERTS,
                                            "optimizer_state": 0}
        for how in ({"load_optimizer_states": False}, {"load_module_only": True}):
            engine = ckpt_engine(world, stage)
            engine.load_checkpoint(root, tag=f"w{stage}", **how)
            got = full_moe_params(engine)
            masters = {}
            for mi in range(len(engine.strategy.masters)):  # every master tensor, whole, by local name
                masters.update(experts.whole_master_state(engine, mi)[0])
            master_diff = 0.0
            for name, p in engine.module.named_parameters():
                value = engine.strategy.full_param_value(p).float().reshape(-1)
                master_diff = max(master_diff, float((masters[name] - value).abs().max()))
            key = f"zero{stage}/{next(iter(how))}"
            out[key] = {"weights": max(float((got[k] - saved[k]).abs().max()) for k in saved),
                        "same_names": set(got) == set(saved), "masters": master_diff,
                        "optimizer_state": sum(len(s) for s in engine.strategy.optimizer.state.values())}
            engine.destroy()
    return out


# --- MoE inside a pipeline: what its checkpoints support -----------------------------------------------------
def pipe_moe_engine(stages: int, ep: int, zero: int) -> Any:
    """The harness's ``moe/ep<ep>`` pipeline in ``stages`` stages (cut by parameters), 2 micro-batches."""
    return pw.build_engine(f"moe/ep{ep}", stages, 2, zero, partition="parameters")


def pipe_moe_state(engine: Any) -> dict[str, Any]:
    """This rank's parameters by name with their Adam moments (ZeRO 1-2: whole, by local name)."""
    from dsrun.checkpoint import experts

    out: dict[str, Any] = {}
    for mi in range(len(engine.strategy.masters)):
        fp32, moments, _ = experts.whole_master_state(engine, mi)
        for name, value in fp32.items():
            out[name] = {"fp32": value.numpy(), **{k: v.numpy() for k, v in moments[name].items()}}
    for name, p in engine.module.named_parameters():
        out[name]["weight"] = p.detach().float().numpy().copy()
    return out


def _refusal(action: Any) -> str | None:
    try:
        action()
    except Exception as err:  # noqa: BLE001 - the message is what the test reads
        return f"{type(err).__name__}: {err}"
    return None


def pipe_moe_checkpoints(rank: int, world: int, root: str) -> dict[str, Any]:
    """One stage x 2 data-parallel ranks with ep=2 at ZeRO-1: two steps, save, a third step; a fresh engine
    loads (each rank's experts back, the same third step); a weights-only load and a ZeRO-2 engine are refused,
    and so is saving at ZeRO-0. Two stages with ep=1 (experts on every rank, like dense layers) save and load
    into one stage x 2 ranks with every parameter as saved."""
    out: dict[str, Any] = {}
    engine = pipe_moe_engine(1, 2, 1)
    pw.train(engine, 2)
    engine.save_checkpoint(root, tag="ep2")
    out["saved"] = pipe_moe_state(engine)
    out["next"] = pw.train(engine, 1, first_step=2)
    engine.destroy()
    engine = pipe_moe_engine(1, 2, 1)
    engine.load_checkpoint(root, tag="ep2")
    out["loaded"] = pipe_moe_state(engine)
    out["loaded_next"] = pw.train(engine, 1, first_step=2)
    out["weights_only"] = _refusal(lambda: engine.load_checkpoint(root, tag="ep2", load_optimizer_states=False))
    engine.destroy()
    engine = pipe_moe_engine(1, 2, 2)
    out["zero2"] = _refusal(lambda: engine.load_checkpoint(root, tag="ep2"))
    engine.destroy()
    engine = pipe_moe_engine(1, 2, 0)
    out["save_zero0"] = _refusal(lambda: engine.save_checkpoint(root, tag="ep2z0"))
    engine.destroy()

    engine = pipe_moe_engine(2, 1, 1)  # dp=1: ep=1, every expert on each stage's one rank
    pw.train(engine, 2)
    engine.save_checkpoint(root, tag="ep1")
    out["ep1_saved"] = pw.named_params(engine)
    engine.destroy()
    engine = pipe_moe_engine(1, 1, 1)
    engine.load_checkpoint(root, tag="ep1")
    out["ep1_loaded"] = pw.named_params(engine)
    engine.destroy()
    return out


# --- MoE with the optimizer (and ZeRO-3's parameters) offloaded to host memory -------------------------------
def offload_engine(world: int, stage: int, offload: bool, offload_param: bool = False) -> Any:
    import dsrun

    zero = {"stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"} if offload else None,
            "offload_param": {"device": "cpu"} if offload_param else None}
    config = moe_config(stage, 2 // world, zero)
    engine, _, _, _ = dsrun.initialize(model=build_model(f"moe_net/ep{world}"), config=config)
    return engine


def offload_moe(rank: int, world: int, root: str) -> dict[str, Any]:
    """ep=2 at ZeRO 1, 2 and 3 with ``offload_optimizer: cpu`` (stage 3 also with ``offload_param: cpu``) and
    the same run in memory: three steps each, then every parameter and expert moment; the offloaded ZeRO-3
    run saves (tag off3) and a fresh in-memory ZeRO-2 engine loads it, an offloaded ZeRO-2 engine loads the
    in-memory ZeRO-3 save (tag mem3)."""
    import dsrun

    dsrun.init_distributed()
    out: dict[str, Any] = {}
    for key, stage, offload, offload_param in (("z1", 1, False, False), ("z1/cpu", 1, True, False),
                                               ("z2", 2, False, False), ("z2/cpu", 2, True, False),
                                               ("z3", 3, False, False), ("z3/cpu", 3, True, False),
                                               ("z3/cpu+param", 3, True, True)):
        engine = offload_engine(world, stage, offload, offload_param)
        losses = [ckpt_step(engine, rank, world, step) for step in range(3)]
        if key in ("z3", "z3/cpu"):
            engine.save_checkpoint(root, tag="off3" if offload else "mem3")
        out[key] = {"losses": losses, "experts": expert_state(engine),
                    "params": {n: engine.strategy.full_param_value(p).numpy()
                               for n, p in engine.module.named_parameters()}}
        engine.destroy()
    for key, stage, offload, tag in (("off3->z2", 2, False, "off3"), ("mem3->z2/cpu", 2, True, "mem3")):
        engine = offload_engine(world, stage, offload)
        engine.load_checkpoint(root, tag=tag)
        out[key] = {"experts": expert_state(engine)}
        engine.destroy()
    return out


def two_rank_suite(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank entry point: every 2-rank run, each into its test's folder under ``root``."""
    return {"first": ckpt_save_first(rank, world, f"{root}/reshard"),
            "resume": resume_same_topology(rank, world, f"{root}/resume"),
            "weights": load_weights_only(rank, world, f"{root}/weights"),
            "pipe": pipe_moe_checkpoints(rank, world, f"{root}/pipe"),
            "offload": offload_moe(rank, world, f"{root}/offload")}


def collect(launch: Runs) -> tuple[Path, dict[str, Any]]:
    """The 2-rank runs (the ep=2 saves among them), then the reshard loads on one rank, then back on two."""
    root = launch.root
    ckpt = str(root / "reshard")
    suite = launch(Launch(two_rank_suite, 2, (str(root),), timeout=600))
    one = launch(Launch(ckpt_load, 1, (ckpt, [("a", 0, "b"), ("z2", 1, None), ("z3", 3, "z3one"), ("z3", 2, None),
                                              ("z2", 3, None)]), timeout=300, rank=0))
    back = launch(Launch(ckpt_load, 2, (ckpt, [("b", 0, None), ("z3one", 3, None), ("b", 3, None)]), timeout=300))
    return root, {"suite": suite, "one": one, "back": back}


def _same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for name in a:
        for key in a[name]:
            np.testing.assert_array_equal(a[name][key], b[name][key], err_msg=f"{name} {key}")


def test_save_ep2_load_ep1_and_back(runs) -> None:
    root, results = runs
    first = [rank["first"] for rank in results["suite"]]
    for tag in ("a", "z3"):  # one file per expert at every stage, ZeRO-3 included
        assert sorted(p.name for p in (root / "reshard" / tag).glob("layer_0_expert_*_model_states.pt")) == \
            [f"layer_0_expert_{g}_mp_rank_00_model_states.pt" for g in range(EXPERTS)]
    saved = {tag: {**first[0][tag]["experts"], **first[1][tag]["experts"]} for tag in ("a", "z2", "z3")}
    assert all(len(experts) == 4 * EXPERTS for experts in saved.values())  # 2 linears x (weight, bias)
    scale = abs(first[0]["a"]["next_loss"])
    bound = fp32_bound(2 * TOKENS, scale) * 64

    def check(result: dict, key: str, source: str) -> None:
        _same(result[key]["experts"], saved[source])
        assert abs(result[key]["next_loss"] - first[0][source]["next_loss"]) <= bound, key
        assert result[key]["global_steps"] == 3, key

    # one rank, ep=1: from stage 0, 2 and 3 into the same stage, stage 3 -> 2 and stage 2 -> 3
    one = results["one"]
    for key, source in (("a->zero0", "a"), ("z2->zero1", "z2"), ("z3->zero3", "z3"), ("z3->zero2", "z3"),
                        ("z2->zero3", "z2")):
        check(one, key, source)
    for key, source in (("a->zero0", "a"), ("z3->zero2", "z3"), ("z2->zero3", "z2")):  # the shared weights too
        for name, value in one[key]["shared"].items():
            np.testing.assert_array_equal(value, first[0][source]["shared"][name], err_msg=f"{key} {name}")
    assert (root / "reshard" / "b" / "layer_0_expert_3_mp_rank_00_optim_states.pt").is_file()

    # back to ep=2 on two ranks: stage 0 and stage 3 saved by one rank, and stage 0 into stage 3
    back = results["back"]
    merged = {key: {"experts": {**back[0][key]["experts"], **back[1][key]["experts"]},
                    "next_loss": back[0][key]["next_loss"], "global_steps": back[0][key]["global_steps"]}
              for key in back[0]}
    for key, source in (("b->zero0", "a"), ("z3one->zero3", "z3"), ("b->zero3", "a")):
        check(merged, key, source)
    # ep 1 -> 2: the optimizer bytes each rank reads by range (the shared groups' elements from the saved
    # optimizer or stage-0 model states file, its experts' from their files) are exactly its share
    for rank in range(2):
        for key in ("b->zero0", "z3one->zero3", "b->zero3"):
            read, share = back[rank][key]["read"]
            assert read == share > 0, (rank, key, read, share)
            # and the module at ZeRO-0 (shared weights and this rank's experts, from their files) straight into the
            # live module, each of its bytes once
            module_read, module_bytes = back[rank][key]["module_read"]
            assert module_read == module_bytes and (module_bytes > 0) == key.endswith("zero0"), (rank, key, module_read)


def test_zero_1_2_3_resume_with_the_saved_topology(runs) -> None:
    root, launched = runs
    results = [rank["resume"] for rank in launched["suite"]]
    for rank, result in enumerate(results):
        for stage, (uninterrupted, resumed) in ((k, v) for k, v in result.items() if not k.endswith("/routed")):
            assert resumed == uninterrupted, f"rank {rank} {stage}: {resumed} != {uninterrupted}"
        # each rank reads its own files back, unless the expert groups were laid out otherwise when saved
        assert [result[f"s{s}/routed"] for s in (1, 2, 3)] == [0, 0, 0] and result["s2/data_first/routed"] == 1
    for stage in (2, 3):
        assert (root / "resume" / f"s{stage}" / "layer_0_expert_3_mp_rank_00_model_states.pt").is_file()


def test_weights_only_loads_take_every_expert_and_keep_the_fresh_optimizer(runs) -> None:
    results = [rank["weights"] for rank in runs[1]["suite"]]
    assert {key.split("/")[0] for key in results[0]} == {"zero0", "zero2", "zero3"}
    for result in results:
        for key, case in result.items():
            assert case["same_names"] and case["weights"] == 0.0 and case["masters"] == 0.0, (key, case)
            assert case["optimizer_state"] == 0, key


def test_pipeline_with_moe_saves_and_loads_at_its_layout_and_refuses_the_rest(runs) -> None:
    root, launched = runs
    results = [rank["pipe"] for rank in launched["suite"]]
    for rank, result in enumerate(results):
        # ep=2: each rank's own experts (weights, fp32 masters, Adam moments) back bit for bit, the same next loss
        _same(result["loaded"], result["saved"])
        assert result["loaded_next"] == result["next"], rank
        for key in ("weights_only", "zero2"):
            assert result[key].startswith("UserError: load_checkpoint(load_dir=...): a pipeline checkpoint of MoE "
                                          "layers with expert parallelism"), (key, result[key])
        assert "needs ZeRO stage 1 or 2" in result["save_zero0"]
        # ep=1 across stage counts: 2 stages x 1 rank -> 1 stage x 2 ranks, every parameter as saved
        saved = {**results[0]["ep1_saved"], **results[1]["ep1_saved"]}
        assert set(result["ep1_loaded"]) == set(saved)
        for name, value in result["ep1_loaded"].items():
            np.testing.assert_array_equal(value, saved[name], err_msg=name)
    assert any(".deepspeed_experts.1." in name for name in results[0]["loaded"])
    assert not (root / "pipe" / "ep2z0").exists()


def test_optimizer_and_parameter_offload_to_host_memory_are_exact_with_moe(runs) -> None:
    results = [rank["offload"] for rank in runs[1]["suite"]]
    for rank, result in enumerate(results):
        for offloaded, in_memory in (("z1/cpu", "z1"), ("z2/cpu", "z2"), ("z3/cpu", "z3"), ("z3/cpu+param", "z3")):
            assert result[offloaded]["losses"] == result[in_memory]["losses"], (rank, offloaded)
            _same(result[offloaded]["experts"], result[in_memory]["experts"])
            for name, value in result[offloaded]["params"].items():
                np.testing.assert_array_equal(value, result[in_memory]["params"][name], err_msg=f"{offloaded} {name}")
        # checkpoints: the offloaded run's expert files load into memory, and the other way round
        _same(result["off3->z2"]["experts"], result["z3/cpu"]["experts"])
        _same(result["mem3->z2/cpu"]["experts"], result["z3"]["experts"])
