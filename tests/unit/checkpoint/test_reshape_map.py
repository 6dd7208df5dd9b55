"""DeepSpeed's checkpoint reshape library (``deepspeed.checkpoint``: ``model_3d_desc``, ``reshape_meg_2d_parallel``,
``get_model_3d_descriptor``, ``DeepSpeedCheckpoint``, ``ZeROCheckpoint``, ``merge_state``) and the engine's
``_checkpoint_parallel_metadata``: which saved files each rank of a smaller layout reads, on files written here."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dsrun.checkpoint import (DeepSpeedCheckpoint, ZeROCheckpoint, get_model_3d_descriptor, merge_state,
                              model_3d_desc, reshape_meg_2d_parallel)
from dsrun.checkpoint.constants import (CHECKPOINT_PARALLEL_DIMS, GROUP_PADDINGS, OPTIMIZER_STATE_DICT,
                                        PARTITION_COUNT, UNIVERSAL_CHECKPOINT_INFO)
from dsrun.checkpoint.deepspeed_checkpoint import _aggregate_autoep_zero12_metadata, _checkpoint_parallel_metadata


def test_contracting_a_layout_hands_each_cell_consecutive_saved_files():
    # files are pipeline-major (file pp * tp + t), ZeRO files data-major on top (+ d * pp * tp)
    grid = reshape_meg_2d_parallel(2, 4, 1, 2)
    assert grid.get_data(0, 0) == [0, 1, 4, 5] and grid.get_data(0, 1) == [2, 3, 6, 7]
    maps = model_3d_desc(pp_degree=2, tp_degree=2, dp_degree=2).reshape(model_3d_desc(1, 2, 1))
    assert len(maps) == 1 and maps[0].get_data(0, 0) == [0, 4, 2, 6] and maps[0].get_data(0, 1) == [1, 5, 3, 7]
    maps = model_3d_desc(2, 2, 2).reshape(model_3d_desc(2, 1, 2))
    assert [m.get_data(1, 0) for m in maps] == [[2, 6], [3, 7]]  # stage 1: files 2, 3 at data ranks 0 and 1
    ok, errors = model_3d_desc(1, 2, 1).can_reshape(model_3d_desc(2, 2, 1))
    assert not ok and errors == ["Expansion reshape not supported - PP: 1 ---> 2"]
    with pytest.raises(AssertionError, match="Expansion"):
        model_3d_desc(1, 2, 1).reshape(model_3d_desc(2, 1, 1))


def _write(folder, dims_per_file, zero_states):
    """Two model-states files (TP=2) and their ZeRO files, as DeepSpeed names them."""
    for mp, dims in enumerate(dims_per_file):
        state = {"param_shapes": [{"w": (2,)}], UNIVERSAL_CHECKPOINT_INFO: {"mp": mp}, "iteration": 7,
                 "ds_config": {}}
        if dims is not None:
            state[CHECKPOINT_PARALLEL_DIMS] = dims
        torch.save(state, folder / f"mp_rank_{mp:02d}_model_states.pt")
        for dp, zero in enumerate(zero_states[mp]):
            torch.save(zero, folder / f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt")


def _zero(values, padding):
    return {OPTIMIZER_STATE_DICT: {"base_optimizer_state": {"state": {0: {"exp_avg": torch.tensor(values),
                                                                          "step": 3}}},
                                   GROUP_PADDINGS: [padding], PARTITION_COUNT: [2]}}


def test_a_folder_is_read_by_its_layout_and_merged_for_a_smaller_one(tmp_path, monkeypatch):
    zeros = [[_zero([1., 2.], 0), _zero([3., 9.], 1)], [_zero([5., 6.], 0), _zero([7., 9.], 1)]]
    _write(tmp_path, [None, None], zeros)  # no recorded degrees: DeepSpeed's inference from the file counts
    desc = get_model_3d_descriptor(str(tmp_path))
    assert (desc.pp_degree, desc.tp_degree, desc.dp_degree) == (1, 2, 2)

    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda path, *a, **k: loads.append(str(path)) or real_load(path, *a, **k))
    checkpoint = DeepSpeedCheckpoint(str(tmp_path), dp_degree=1)  # the two data ranks merged into one
    assert [p for p in loads if p.endswith("model_states.pt")] == checkpoint.mp_rank_files  # each read once
    assert checkpoint.get_checkpoint_info(UNIVERSAL_CHECKPOINT_INFO) == {"mp": 0} and checkpoint.get_iteration() == 7
    assert checkpoint.get_zero_files(0, 1, 0) == [str(tmp_path / f"zero_pp_rank_{d}_mp_rank_01_optim_states.pt")
                                                  for d in (0, 1)]
    merged = checkpoint.get_zero_checkpoint_state(0, 1, 0)[OPTIMIZER_STATE_DICT]
    # each file's padding stripped, the tensors concatenated, the scalars kept, the counts set for one data rank
    assert torch.equal(merged["base_optimizer_state"]["state"][0]["exp_avg"], torch.tensor([5., 6., 7.]))
    assert merged["base_optimizer_state"]["state"][0]["step"] == 3
    assert merged[GROUP_PADDINGS] == [0] and merged[PARTITION_COUNT] == [1]
    assert ZeROCheckpoint(str(tmp_path)).get_files_for_rank(0, 0, 1)[0].endswith("zero_pp_rank_1_mp_rank_00_optim_states.pt")


def test_recorded_degrees_win_and_must_agree(tmp_path):
    zeros = [[{}, {}], [{}, {}]]
    _write(tmp_path, [{"pp_degree": 2, "tp_degree": 1}] * 2, zeros)
    desc = get_model_3d_descriptor(str(tmp_path))
    assert (desc.pp_degree, desc.tp_degree, desc.dp_degree) == (2, 1, 2)
    _write(tmp_path, [{"pp_degree": 2, "tp_degree": 1}, None], zeros)
    with pytest.raises(RuntimeError, match="missing from model-state files"):
        get_model_3d_descriptor(str(tmp_path))
    _write(tmp_path, [{"pp_degree": 2, "tp_degree": 1}, {"pp_degree": 1, "tp_degree": 2}], zeros)
    with pytest.raises(RuntimeError, match="disagrees across model-state files"):
        get_model_3d_descriptor(str(tmp_path))


def test_the_engine_records_the_mpus_degrees_and_autoep_metadata_is_checked():
    mpu = SimpleNamespace(get_pipe_parallel_world_size=lambda: 2, get_slice_parallel_world_size=lambda: 3)
    assert _checkpoint_parallel_metadata(mpu) == {CHECKPOINT_PARALLEL_DIMS: {"pp_degree": 2, "tp_degree": 3}}
    assert _checkpoint_parallel_metadata(None)[CHECKPOINT_PARALLEL_DIMS] == {"pp_degree": 1, "tp_degree": 1}
    layer = {"expert_key_prefix": "m.experts", "num_experts": 4, "num_local_experts": 2, "ep_size": 2}
    meta = [(f"f{i}", {"param_shapes": {"w": (i,)}, "ds_autoep_layers": [layer], "ds_config": {}}) for i in (1, 2)]
    assert _aggregate_autoep_zero12_metadata(meta) == ([{"w": (1,)}, {"w": (2,)}], [layer], False)
    meta[1][1]["ds_autoep_layers"] = [{**layer, "ep_size": 4}]
    with pytest.raises(RuntimeError, match="Conflicting AutoEP metadata"):
        _aggregate_autoep_zero12_metadata(meta)
    # two ranks' states: tensors concatenated along dim 0, anything else kept from the first
    merged = merge_state({"a": [torch.ones(1)], "n": 1}, {"a": [torch.zeros(2)], "n": 2})
    assert torch.equal(merged["a"][0], torch.tensor([1., 0., 0.])) and merged["n"] == 1
