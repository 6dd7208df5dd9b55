"""Pure functions: file names, tags, the master-weight layouts of every stage, and resharding N -> M."""
from __future__ import annotations

import math
import pickle
from collections import OrderedDict

import pytest
import torch

from dsrun.checkpoint import layout, reshard
from dsrun.checkpoint.safe_load import UnsafeCheckpointError, load_file
from dsrun.utils.errors import UserError
from dsrun.utils.zero_to_fp32 import master_slots, natural_key

SHAPES = [OrderedDict([("a", torch.Size([3, 5])), ("b", torch.Size([7])), ("c", torch.Size([2, 2]))]),
          OrderedDict([("d", torch.Size([11]))])]


def test_names_follow_deepspeed():
    assert layout.model_states_name(2, 5) == "mp_rank_00_model_states.pt"
    assert layout.model_states_name(3, 5) == "zero_pp_rank_5_mp_rank_00_model_states.pt"
    assert layout.optim_states_name(12, bf16=True) == "bf16_zero_pp_rank_12_mp_rank_00_optim_states.pt"
    assert layout.optim_states_name(0, bf16=False) == "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert layout.default_tag(14) == "global_step14"
    assert sorted(["r_10", "r_2", "r_1"], key=natural_key) == ["r_1", "r_2", "r_10"]


@pytest.mark.parametrize("tag", ["", ".hidden", "a/b", "..", "x y"])
def test_bad_tags_rejected(tag):
    with pytest.raises(UserError):
        layout.check_tag(tag)


def test_list_tags_orders_by_step_and_ignores_incomplete(tmp_path):
    for tag in ("global_step10", "global_step9", "global_step100"):
        (tmp_path / tag).mkdir()
        (tmp_path / tag / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (tmp_path / "global_step200").mkdir()  # no model states: not a checkpoint
    (tmp_path / ".global_step300.staging").mkdir()
    assert layout.list_tags(tmp_path) == ["global_step9", "global_step10", "global_step100"]


def _full(shapes):
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(math.prod(s), generator=gen) for g in shapes for n, s in g.items()}


@pytest.mark.parametrize("stage,world", [(0, 1), (1, 3), (2, 4), (3, 3)])
def test_master_slots_cover_every_element_once(stage, world):
    full = _full(SHAPES)
    rebuilt = {n: torch.full_like(v, float("nan")) for n, v in full.items()}
    for rank in range(world):
        slots, lengths = master_slots(stage, world, rank, SHAPES)
        for group_slots, length in zip(slots, lengths):
            master = torch.zeros(length)
            for s in group_slots:
                master[s.master_offset:s.master_offset + s.length] = full[s.name][s.full_offset:s.full_offset + s.length]
            for s in group_slots:
                assert torch.isnan(rebuilt[s.name][s.full_offset:s.full_offset + s.length]).all()  # once
                rebuilt[s.name][s.full_offset:s.full_offset + s.length] = master[s.master_offset:s.master_offset + s.length]
        if stage in (1, 2):
            assert all(length % 1 == 0 and length * world % (2 * world) == 0 for length in lengths)
    assert all(torch.equal(rebuilt[n], full[n]) for n in full)


def _rank_states(full, moments, stage, world):
    """What each rank of a ``stage``/``world`` run would save, built from full values."""
    states = []
    for rank in range(world):
        slots, lengths = master_slots(stage, world, rank, SHAPES)
        masters, state = [], {}
        for mi, (group_slots, length) in enumerate(zip(slots, lengths)):
            master, m = torch.zeros(length), torch.zeros(length)
            for s in group_slots:
                master[s.master_offset:s.master_offset + s.length] = full[s.name][s.full_offset:s.full_offset + s.length]
                m[s.master_offset:s.master_offset + s.length] = moments[s.name][s.full_offset:s.full_offset + s.length]
            masters.append(master)
            state[mi] = {"step": 7, "exp_avg": m}
        groups = [{"lr": 0.1 * (i + 1), "params": [i]} for i in range(len(SHAPES))]
        states.append({"zero_stage": stage, "partition_count": world, "single_partition_of_fp32_groups": masters,
                       "base_optimizer_state": {"state": state, "param_groups": groups},
                       "loss_scaler": {"cur_scale": 8.0}})
    return states


@pytest.mark.parametrize("src,dst", [((2, 4), (2, 2)), ((1, 2), (1, 3)), ((2, 3), (0, 1)), ((0, 1), (1, 2))])
def test_reshard_round_trip(src, dst):
    full, moments = _full(SHAPES), {n: v * 3 for n, v in _full(SHAPES).items()}
    merged = reshard.merge_rank_states(_rank_states(full, moments, *src), src[0], SHAPES)
    assert all(torch.equal(merged.fp32[n], full[n]) for n in full)
    assert all(torch.equal(merged.moments[n]["exp_avg"], moments[n]) for n in full)
    expected = _rank_states(full, moments, *dst)
    for rank in range(dst[1]):
        template = _rank_states({n: torch.zeros_like(v) for n, v in full.items()},
                                {n: torch.zeros_like(v) for n, v in full.items()}, *dst)[rank]
        got = reshard.state_for_rank(template, merged, dst[0], dst[1], rank, SHAPES)
        for a, b in zip(got["single_partition_of_fp32_groups"], expected[rank]["single_partition_of_fp32_groups"]):
            assert torch.equal(a, b)
        for mi, entry in expected[rank]["base_optimizer_state"]["state"].items():
            assert torch.equal(got["base_optimizer_state"]["state"][mi]["exp_avg"], entry["exp_avg"])
            assert got["base_optimizer_state"]["state"][mi]["step"] == 7
        assert [g["lr"] for g in got["base_optimizer_state"]["param_groups"]] == [0.1, 0.2]
        assert got["loss_scaler"] == {"cur_scale": 8.0}


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_safe_load_refuses_code(tmp_path, capsys):
    path = tmp_path / "evil.pt"
    torch.save({"module": {}, "payload": Evil()}, path)
    with pytest.raises(UnsafeCheckpointError, match="refusing to load"):
        load_file(path)
    assert "pwned" not in capsys.readouterr().out
    ok = tmp_path / "ok.pt"
    torch.save({"shapes": [OrderedDict(w=torch.Size([2]))], "t": torch.ones(2)}, ok)
    assert load_file(ok)["shapes"][0]["w"] == torch.Size([2])
    assert pickle  # (pickle is what weights_only=True guards against)


def test_a_layout_that_refuses_resharding_stops_a_resharded_load(tmp_path):
    """A strategy whose layout names a refusal (MiCS: masters cut over shard groups) loads only its own layout;
    every stage's plain layout reshards."""
    import dataclasses
    from types import SimpleNamespace

    from dsrun.checkpoint.engine_io import _refuse_reshard

    for stage in range(4):
        assert layout.layout_for_stage(stage).reshard_refusal is None
        _refuse_reshard(SimpleNamespace(checkpoint_layout=layout.layout_for_stage(stage)), tmp_path, "x")
    mics = dataclasses.replace(layout.layout_for_stage(3), reshard_refusal="a MiCS run (mics_shard_size 2)")
    with pytest.raises(RuntimeError, match=r"a MiCS run \(mics_shard_size 2\) loads only a checkpoint of its own "
                                           r"layout \(saved: stage 3 on 4 ranks\)"):
        _refuse_reshard(SimpleNamespace(checkpoint_layout=mics), tmp_path, "stage 3 on 4 ranks")
