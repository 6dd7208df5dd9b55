"""AutoTP's universal-checkpoint metadata and DeepSpeed's conversion helpers, in one process: what each split
parameter records (``ds_autotp_universal_checkpoint_meta``), ``collect_autotp_universal_checkpoint_info``, the
merge of per-rank slices (``merge_tp_slices``, DeepSpeed's ZeRO-3 grid conversion) and the restore of a rank's
slice (``_resolve_autotp_partition``, ``load_hp_checkpoint_state``), each checked against slices cut here."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dsrun.checkpoint import constants as C
from dsrun.checkpoint.autotp_meta import (_build_param_uc_restore_meta, _resolve_autotp_partition,
                                          collect_autotp_universal_checkpoint_info, mark_split)
from dsrun.checkpoint.ds_to_universal import main as convert
from dsrun.checkpoint.safe_load import load_file
from dsrun.checkpoint.tp_slices import _validate_autotp_conversion_support, dump_param_fragment, merge_tp_slices
from dsrun.checkpoint.universal_checkpoint import SubparamShape, enable_universal_checkpoint
from dsrun.compat.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from dsrun.tensor_parallel.deepspeed_layers import LinearAllreduce, LinearLayer, _subparam_shard_widths


class _Block(nn.Module):
    def __init__(self, rank: int, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lm_head = LinearLayer(nn.Linear(8, 101), None, tp_rank=rank, tp_size=2, name="lm_head")
        self.proj = LinearAllreduce(nn.Linear(10, 8), None, tp_rank=rank, tp_size=2, name="proj")
        self.norm = nn.LayerNorm(8)


def test_deepspeed_layers_record_their_cut_and_the_model_info_says_how_to_merge():
    whole = _Block(0, seed=0)  # the same seed: each rank's layers cut the same whole weights
    torch.manual_seed(0)
    full_head, full_proj = nn.Linear(8, 101).weight.detach(), nn.Linear(10, 8).weight.detach()
    for rank, rows in ((0, slice(0, 51)), (1, slice(51, 101))):
        block = whole if rank == 0 else _Block(1, seed=0)
        meta = getattr(block.lm_head.weight, C.DS_AUTOTP_UC_META)
        assert (meta["logical_shape"], meta["partition_sizes"], meta["target_partition_shape"]) == \
            ((101, 8), (51, 50), (rows.stop - rows.start, 8))
        # the rank's slice of the whole value, by the metadata alone
        assert torch.equal(_resolve_autotp_partition(block.lm_head.weight, {}, full_head, rank, 2),
                           full_head[rows].flatten())
        assert torch.equal(_resolve_autotp_partition(block.proj.weight, {}, full_proj, rank, 2),
                           full_proj[:, 5 * rank:5 * rank + 5].flatten())
    info = collect_autotp_universal_checkpoint_info(whole)
    assert info[C.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS] == [r"^proj\.weight$"]
    assert info[C.TP_REPLICATED_PARAMETER_PATTERNS] == [r"^norm\.bias$", r"^norm\.weight$", r"^proj\.bias$"]
    assert info[C.VOCABULARY_PARAMETER_PATTERNS] == [r"^lm_head\.weight$"] and info[C.ORIGINAL_VOCAB_SIZE] == 101
    assert info[C.PARAMETER_WITH_SUB_PARAMS] == [] and info[C.AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS] == {}


def _slices_of(whole: torch.Tensor, widths: list[list[int]], rank: int) -> torch.Tensor:
    pieces, start = [], 0
    for part in widths:
        pieces.append(whole[start + sum(part[:rank]):start + sum(part[:rank + 1])])
        start += sum(part)
    return torch.cat(pieces)


@pytest.mark.parametrize("sizes,tp", [((6, 3, 3), 2), ((8, 2, 2), 4)])
def test_a_fused_parameter_merges_part_by_part_and_each_rank_restores_its_slice(tmp_path, sizes, tp):
    widths = _subparam_shard_widths(sizes, tp)  # (8, 2, 2) over 4: some ranks hold none of k and v
    assert all(sum(w) == s for w, s in zip(widths, sizes))
    whole = torch.arange(sum(sizes) * 3, dtype=torch.float32).view(sum(sizes), 3)
    model = nn.Module()
    model.qkv = nn.Linear(3, sum(sizes), bias=False)
    rank_slices = [_slices_of(whole, widths, r) for r in range(tp)]
    for rank, piece in enumerate(rank_slices):  # DeepSpeed's slice files: two data ranks' fragments per rank
        half = piece.numel() // 2
        for dp, (offset, numel) in enumerate(((0, half), (half, piece.numel() - half))):
            for state in ("fp32", "exp_avg", "exp_avg_sq"):
                dump_param_fragment(str(tmp_path / "slices"), rank, dp, state, piece.flatten() * (1 + len(state)),
                                    "qkv.weight", offset, numel)
    mark_split(model.qkv.weight, row=False, dim=0, whole_shape=whole.shape, widths=widths)
    info = collect_autotp_universal_checkpoint_info(model)
    assert info[C.SUB_PARAM_SHARD_WIDTHS] == {r"^qkv\.weight$": widths}
    merge_tp_slices(info, str(tmp_path / "out"), str(tmp_path / "slices"), tp,
                    ("qkv.weight", [tuple(s.shape) for s in rank_slices]))
    saved = load_file(tmp_path / "out" / "qkv.weight" / "fp32.pt")  # the safe loader takes the SubparamShape
    assert torch.equal(saved[C.PARAM], whole * 5) and isinstance(saved[C.SUB_PARAM_SHAPE], SubparamShape)
    for rank in range(tp):  # the restore cuts back exactly what each rank held
        assert torch.equal(_resolve_autotp_partition(model.qkv.weight, saved, whole, rank, tp),
                           rank_slices[rank].flatten())


def test_a_layout_no_merge_can_undo_is_refused_at_conversion_and_restore():
    param = nn.Parameter(torch.zeros(6, 4))
    setattr(param, C.DS_AUTOTP_UC_META, _build_param_uc_restore_meta(
        partition_type="column", partition_dim=0, logical_shape=(12, 4), unsupported_reason="interleaved q|k|v"))
    model = nn.Module()
    model.register_parameter("qkv", param)
    info = collect_autotp_universal_checkpoint_info(model)
    assert info[C.AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS] == {r"^qkv$": "interleaved q|k|v"}
    with pytest.raises(ValueError, match=r"\^qkv\$: interleaved q\|k\|v"):
        _validate_autotp_conversion_support(info)
    with pytest.raises(RuntimeError, match="interleaved"):
        _resolve_autotp_partition(param, {}, torch.zeros(48), 0, 2)


def _write_zero3_grid(folder: Path, shards: dict[str, list[torch.Tensor]], dp: int, info: dict) -> None:
    """DeepSpeed's ZeRO-3 files of a tp x dp grid: each data rank's ceil(numel/dp) piece of every parameter
    (the last padded), the tensor ranks' own shapes."""
    folder.mkdir()
    for tp in range(len(next(iter(shards.values())))):
        pieces = {d: [] for d in range(dp)}
        for tensors in shards.values():
            flat = tensors[tp].flatten()
            per = -(-flat.numel() // dp)
            flat = torch.cat([flat, flat.new_zeros(per * dp - flat.numel())])
            for d in range(dp):
                pieces[d].append(flat[d * per:(d + 1) * per])
        shapes = [{name: list(t[tp].shape) for name, t in shards.items()}]
        for d in range(dp):
            part = torch.cat(pieces[d])
            optim = {C.OPTIMIZER_STATE_DICT: {"state": [{"exp_avg": part * 10, "exp_avg_sq": part * 100}],
                                              C.PARAM_GROUPS: [{"lr": 0.1}]}, C.FP32_FLAT_GROUPS: [part],
                     C.ZERO_STAGE: 3}
            stem = folder / f"zero_pp_rank_{d}_mp_rank_{tp:02d}"
            torch.save({C.PARAM_SHAPES: shapes, C.UNIVERSAL_CHECKPOINT_INFO: info}, f"{stem}_model_states.pt")
            torch.save({C.OPTIMIZER_STATE_DICT: optim}, f"{stem}_optim_states.pt")


def test_deepspeeds_zero3_autotp_grid_converts_to_whole_values(tmp_path):
    fc, ln = torch.arange(20.).view(5, 4), torch.tensor([1., 2., 3.])
    info = {C.UNIVERSAL_CHECKPOINT_VERSION_KEY: 0.4, C.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [],
            C.TP_REPLICATED_PARAMETER_PATTERNS: [r"^ln\.weight$"], C.PARAMETER_WITH_SUB_PARAMS: []}
    _write_zero3_grid(tmp_path / "ckpt", {"fc.weight": [fc[:3], fc[3:]], "ln.weight": [ln, ln]}, 2, info)
    convert(SimpleNamespace(input_folder=str(tmp_path / "ckpt"), output_folder=str(tmp_path / "uc"), strict=True,
                            keep_temp_folder=False))
    for state, scale in (("fp32", 1), ("exp_avg", 10), ("exp_avg_sq", 100)):
        saved = torch.load(tmp_path / "uc" / "zero" / "fc.weight" / f"{state}.pt", weights_only=False)
        assert saved[C.CAT_DIM] == 0 and torch.equal(saved[C.PARAM], fc * scale)
    assert torch.equal(torch.load(tmp_path / "uc" / "zero" / "ln.weight" / "fp32.pt", weights_only=False)[C.PARAM], ln)
    assert (tmp_path / "latest_universal").read_text() == "uc" and not (tmp_path / "uc" / "tmp").exists()
    _write_zero3_grid(tmp_path / "one", {"fc.weight": [fc]}, 2, {})  # one tensor rank: DeepSpeed writes it flat
    convert(SimpleNamespace(input_folder=str(tmp_path / "one"), output_folder=str(tmp_path / "uc1")))
    assert torch.equal(torch.load(tmp_path / "uc1" / "zero" / "fc.weight" / "fp32.pt", weights_only=False),
                       fc.flatten())


def test_load_hp_checkpoint_state_fills_this_ranks_fragment_and_the_optimizer_names_bind_it(tmp_path):
    whole = torch.arange(32.).view(4, 8)
    for state, scale in (("fp32", 1), ("exp_avg", 2)):
        torch.save({C.PARAM: whole * scale, C.CAT_DIM: 1}, tmp_path / f"{state}.pt")
    torch.save(5, tmp_path / "step.pt")
    param = nn.Parameter(torch.zeros(4, 4))  # tensor rank 1 of 2 of a row-parallel weight
    mark_split(param, row=True, dim=1, whole_shape=(4, 8), widths=[[4, 4]])
    master = torch.zeros(6)
    param._hp_mapping = SimpleNamespace(lp_fragment_address=SimpleNamespace(start=3, numel=6),
                                        get_hp_fragment=lambda: master)
    param.universal_checkpoint_info = {"from": "the model"}
    optimizer = object.__new__(DeepSpeedZeroOptimizer)
    optimizer.bit16_groups = [[param]]
    optimizer._enable_universal_checkpoint()  # binds load_hp_checkpoint_state, keeps the model's info
    assert optimizer._get_universal_checkpoint_info() == {"from": "the model"}
    assert param.load_hp_checkpoint_state(str(tmp_path), tp_rank=1, tp_world_size=2) == 5
    rank_slice = whole[:, 4:].flatten()
    assert torch.equal(master, rank_slice[3:9])
    assert torch.equal(param._hp_mapping.optim_fragment["exp_avg"], rank_slice[3:9] * 2)
    plain = nn.Parameter(torch.zeros(2, 8))  # no metadata: cut back as the file says it was merged
    enable_universal_checkpoint([plain])
    plain._hp_mapping = SimpleNamespace(lp_fragment_address=SimpleNamespace(start=0, numel=16),
                                        get_hp_fragment=lambda: master2)
    master2 = torch.zeros(16)
    (tmp_path / "step.pt").unlink()
    assert plain.load_hp_checkpoint_state(str(tmp_path), tp_rank=1, tp_world_size=2) is None
    assert torch.equal(master2, whole.chunk(2, dim=1)[1].flatten())


def test_a_split_layer_without_metadata_is_described_from_its_megatron_marks():
    """A layer that cuts its parameters with Megatron's marks but records no metadata (dsrun's split layers before
    ``universal_checkpoint_info`` marks them): collect derives the metadata from the marks, never calling the
    parameter replicated."""
    from dsrun.inference.groups import TPGroup
    from dsrun.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from dsrun.tensor_parallel.split import cut_parameter

    model = nn.Module()
    fused, plain, row = nn.Linear(4, 12), nn.Linear(4, 12), nn.Linear(6, 4)
    cut_parameter(fused.weight, 0, ((4, 2), (2, 1), (2, 1)), TPGroup(None, 1, 2))  # explicit widths
    cut_parameter(plain.weight, 0, 3, TPGroup(None, 1, 2))  # 3 equal parts cut evenly
    cut_parameter(row.weight, 1, 1, TPGroup(None, 1, 2))
    model.fused = ColumnParallelLinear(fused.weight, None, False, None, 2, 1)
    model.plain = ColumnParallelLinear(plain.weight, None, False, None, 2, 1)
    model.row = RowParallelLinear(row.weight, row.bias, False, None, 2, 1)
    info = collect_autotp_universal_checkpoint_info(model)
    assert info[C.SUB_PARAM_SHARD_WIDTHS] == {r"^fused\.weight$": [[4, 2], [2, 1], [2, 1]],
                                              r"^plain\.weight$": [[2, 2], [2, 2], [2, 2]]}
    assert info[C.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS] == [r"^row\.weight$"]
    assert info[C.TP_REPLICATED_PARAMETER_PATTERNS] == [r"^row\.bias$"]  # never cut: whole on every rank
    assert getattr(model.row.weight, C.DS_AUTOTP_UC_META)["logical_shape"] == (4, 6)


def test_deepspeeds_fused_layers_record_each_sub_parameters_widths():
    """GateUpPack_LinearLayer (gate|up of 6 each over 2 ranks): recorded per sub-parameter, not as a plain cut."""
    from dsrun.tensor_parallel.subparam_layers import GateUpPack_LinearLayer

    model = nn.Module()
    model.up = GateUpPack_LinearLayer(nn.Linear(4, 12), None, tp_rank=1, tp_size=2, name="dense_h_to_4h")
    info = collect_autotp_universal_checkpoint_info(model)
    assert info[C.SUB_PARAM_SHARD_WIDTHS][r"^up\.weight$"] == [[3, 3], [3, 3]]
    whole = torch.arange(48.).view(12, 4)
    assert torch.equal(_resolve_autotp_partition(model.up.weight, {}, whole, 1, 2),
                       torch.cat([whole[3:6], whole[9:12]]).flatten())
