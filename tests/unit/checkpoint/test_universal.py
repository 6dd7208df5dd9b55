"""Universal checkpoints on one rank, in process: the conversion's files, an exact round trip into another
stage, custom_load_fn, and the CLI's refusals (multi-rank layouts: tests/integration/test_universal_checkpoint.py)."""
from __future__ import annotations

import pytest
import torch

from dsrun.checkpoint import ds_to_universal, universal_checkpoint
from tests.helpers import run_cli

from .conftest import make_engine, train

pytestmark = pytest.mark.usefixtures("single_rank")


@pytest.mark.parametrize("saved_stage,new_stage", [(3, 1), (1, 3), (0, 2)])
def test_a_universal_checkpoint_continues_exactly_at_another_stage(tmp_path, capsys, saved_stage, new_stage):
    engine = make_engine(saved_stage)
    train(engine, 3)
    engine.save_checkpoint(str(tmp_path), client_state={"note": 7})
    expected = train(engine, 2, start=3)
    args = ds_to_universal.parse_arguments(["--input_folder", str(tmp_path / "global_step3"), "--output_folder",
                                            str(tmp_path / "global_step3_universal"), "--num_extract_workers", "8"])
    ds_to_universal.main(args)
    assert universal_checkpoint.read_latest_universal(tmp_path) == "global_step3_universal"
    other = make_engine(new_stage, extra={"checkpoint": {"load_universal": True}})
    path, client = other.load_checkpoint(str(tmp_path))
    assert "global_step3_universal" in path and client["note"] == 7 and other.global_steps == 3
    assert (f"loading universal checkpoint global_step3_universal (saved by 1 rank(s) at ZeRO stage {saved_stage}) "
            f"into 1 rank(s) at stage {new_stage}") in capsys.readouterr().out
    # one rank: the same sums in the same order, so the continuation is exact
    assert train(other, 2, start=3) == expected


def test_load_checkpoint_custom_load_fn_gets_the_full_weights(tmp_path):
    engine = make_engine(3)
    train(engine, 1)
    engine.save_checkpoint(str(tmp_path))
    seen = {}

    def loader(src, dst):
        seen.update({k: v.clone() for k, v in src.items()})
        dst.load_state_dict(src, strict=False)

    other = make_engine(1)
    other.load_checkpoint(str(tmp_path), custom_load_fn=loader, load_optimizer_states=False)
    from dsrun.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    full = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    for name, value in full.items():  # stage 3's placeholders were replaced by the full masters
        assert torch.equal(seen[name].float(), value), name
        assert torch.equal(other.module.state_dict()[name].float(), value), name


def test_the_cli_refuses_a_folder_that_is_not_a_checkpoint_tag(tmp_path):
    missing = run_cli("convert", "ds-to-universal", str(tmp_path / "nope"), str(tmp_path / "out"))
    assert missing.returncode == 2 and "is not a folder" in missing.stderr and "Traceback" not in missing.stderr
    empty = run_cli("convert", "ds-to-universal", str(tmp_path), str(tmp_path / "out"))
    assert empty.returncode == 2 and "model_states.pt" in empty.stderr


@pytest.mark.parametrize("shape,dim,parts", [((6, 12), 1, 3), ((12, 5), 0, 2), ((8,), 0, 1), ((2, 3, 8), 2, 2),
                                             ((5, 7), 1, 1), ((9, 4), 0, 3), ((32, 5), 0, ((8, 8), (4, 4), (4, 4))),
                                             ((3, 48), 1, ((32, 16),)), ((2, 14, 3), 1, ((4, 2), (5, 3)))])
def test_a_tensor_parallel_ranks_slice_of_a_whole_value_is_read_by_ranges(shape, dim, parts):
    """A universal folder's whole values seen by TP rank r of 2 (tensor_parallel.RankSlices): any element range of
    the rank's flattened slice is that range of ``slice_dim`` of the whole value (fused parts cut per part; an
    uneven cut, 7 columns or 3 rows per part over 2 ranks, gives the first rank one more; explicit widths: a
    fused q|k|v of unequal parts, a cut in grains of 32, unequal parts cut unevenly)."""
    from dsrun.checkpoint import reshard, tensor_parallel as tp
    from dsrun.utils.zero_to_fp32 import merge_slices as z2f_merge

    whole = torch.arange(torch.Size(shape).numel(), dtype=torch.float32)
    source = reshard.FullOptimizerState(fp32={"w": whole, "b": whole.clone()},
                                        moments={"w": {"exp_avg": -whole}})
    for rank in range(2):
        cut = tp.universal_rank_source(source, [{"w": shape, "b": shape}], {"w": (dim, parts)}, rank, 2)
        expected = tp.slice_dim(whole.view(shape), dim, parts, rank, 2).reshape(-1)
        if not isinstance(parts, int):  # the ranks' slices put back together are the whole value
            assert torch.equal(z2f_merge([tp.slice_dim(whole.view(shape), dim, parts, r, 2) for r in range(2)], dim,
                                         parts), whole.view(shape))
        for start, count in ((0, expected.numel()), (1, expected.numel() - 2), (expected.numel() // 2, 2), (expected.numel() - 1, 1)):
            out = torch.empty(count)
            cut.copy_range("w", None, start, out)
            assert torch.equal(out, expected[start:start + count]), (rank, start, count)
            cut.copy_range("w", "exp_avg", start, out)
            assert torch.equal(out, -expected[start:start + count])
        out = torch.empty(4)
        cut.copy_range("b", None, 2, out)  # a whole parameter: the whole value's range
        assert torch.equal(out, whole[2:6])
    assert tp.universal_rank_source(source, None, {"w": (dim, parts)}, 0, 1) is source  # one rank: no cut
    # the reverse (a TP checkpoint's conversion, tensor_parallel.MergedRanks): any range of the whole value read
    # from the ranks' slices, each slice element read once when the whole value is read
    slices = [tp.slice_dim(whole.view(shape), dim, parts, r, 2).reshape(-1) for r in range(2)]
    reads = [0, 0]

    class Counted(reshard.FullOptimizerState):
        def copy_range(self, name, key, full_offset, out):
            reads[self.rank] += out.numel()
            super().copy_range(name, key, full_offset, out)

    sources = []
    for r in range(2):
        sources.append(Counted(fp32={"w": slices[r], "b": whole.clone()}))
        sources[-1].rank = r
    merged = tp.MergedRanks(sources, {"w": (dim, parts)}, {"w": torch.Size(shape), "b": torch.Size(shape)})
    for start, count in ((0, whole.numel()), (1, whole.numel() - 2), (whole.numel() // 3, 5)):
        out = torch.empty(count)
        merged.copy_range("w", None, start, out)
        assert torch.equal(out, whole[start:start + count]), (start, count)
        if start == 0:
            assert reads == [s.numel() for s in slices]
