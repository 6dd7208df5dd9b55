"""Partial reads: a resharded or universal load reads, on each rank, only the elements that rank will own
(dsrun/checkpoint/partial_state.py), and what it loads is bit for bit what the merged, read-everything path
gives (reshard.merge_rank_states)."""
from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch

from dsrun.checkpoint import ds_to_universal, partial_state, reshard, tensor_file
from dsrun.checkpoint.saved_tag import rank_optimizer_states
from dsrun.utils.zero_to_fp32 import master_slots
from tests.helpers import run_ranks

from .conftest import make_engine, train

SHAPES = [OrderedDict([("a", torch.Size([30, 50])), ("b", torch.Size([70])), ("c", torch.Size([20, 20]))]),
          OrderedDict([("d", torch.Size([110]))])]


def assert_same(got, expected, where="state"):
    """Equal containers and bitwise-equal tensors of the same dtype."""
    if torch.is_tensor(expected):
        assert torch.is_tensor(got) and got.dtype == expected.dtype and torch.equal(got, expected), where
    elif isinstance(expected, dict):
        assert set(got) == set(expected), where
        for key in expected:
            assert_same(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == expected, where


def _saved_ranks(folder, stage, world, moment_dtype=torch.float32, legacy=False):
    """Each rank's optimizer file of a ``stage``/``world`` save, in the ZeRO layout, from random full values."""
    gen = torch.Generator().manual_seed(stage * 10 + world)
    full = {n: torch.randn(math.prod(s), generator=gen) for g in SHAPES for n, s in g.items()}
    moments = {n: torch.randn(v.numel(), generator=gen).to(moment_dtype) for n, v in full.items()}
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for rank in range(world):
        slots, lengths = master_slots(stage, world, rank, SHAPES)
        masters, state = [], {}
        for mi, (group_slots, length) in enumerate(zip(slots, lengths)):
            master, m = torch.zeros(length), torch.zeros(length, dtype=moment_dtype)
            for s in group_slots:
                master[s.master_offset:s.master_offset + s.length] = full[s.name][s.full_offset:s.full_offset + s.length]
                m[s.master_offset:s.master_offset + s.length] = moments[s.name][s.full_offset:s.full_offset + s.length]
            masters.append(master)
            state[mi] = {"step": torch.tensor(7.0 + mi), "exp_avg": m, "exp_avg_sq": m * 2}
        groups = [{"lr": 0.1 * (i + 1), "betas": (0.9, 0.99), "params": [i]} for i in range(len(SHAPES))]
        key, masters_key = (("optimizer_state_dict", "fp32_flat_groups") if stage == 3
                            else ("base_optimizer_state", "single_partition_of_fp32_groups"))
        osd = {"zero_stage": stage, "partition_count": world, masters_key: masters,
               key: {"state": state, "param_groups": groups}, "loss_scaler": {"cur_scale": torch.tensor(8.0)}}
        path = folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        torch.save({"optimizer_state_dict": osd}, path, _use_new_zipfile_serialization=not legacy)
        paths.append(path)
    return paths


def _template(stage, world, rank):
    """What the live strategy's state_dict() holds before the load: its layout, fresh values."""
    slots, lengths = master_slots(stage, world, rank, SHAPES)
    key, masters_key = (("optimizer_state_dict", "fp32_flat_groups") if stage == 3
                        else ("base_optimizer_state", "single_partition_of_fp32_groups"))
    groups = [{"lr": 1.0, "betas": (0.5, 0.5), "params": [i]} for i in range(len(SHAPES))]
    return {"zero_stage": stage, "partition_count": world, masters_key: [torch.zeros(n) for n in lengths],
            key: {"state": {}, "param_groups": groups}}


def _share_bytes(stage, world, rank, moment_bytes):
    """The bytes of the rank's own elements: fp32 masters and two moments."""
    slots, _ = master_slots(stage, world, rank, SHAPES)
    return sum(s.length for group in slots for s in group) * (4 + 2 * moment_bytes)


@pytest.mark.parametrize("src,dst,moment_dtype", [((3, 2), (3, 1), torch.float32), ((3, 1), (3, 2), torch.float32),
                                                  ((2, 4), (3, 3), torch.bfloat16), ((3, 3), (1, 2), torch.float32),
                                                  ((1, 2), (0, 1), torch.float32)])
def test_partial_reads_load_the_merged_state_reading_the_ranks_share(tmp_path, src, dst, moment_dtype):
    paths = _saved_ranks(tmp_path, *src, moment_dtype=moment_dtype)
    merged = reshard.merge_rank_states(rank_optimizer_states(tmp_path, {}, src[0], src[1], False), src[0], SHAPES)
    total = sum(p.stat().st_size for p in paths)
    for rank in range(dst[1]):
        expected = reshard.state_for_rank(_template(*dst, rank), merged, *dst, rank, SHAPES)
        tensor_file.reset_read_stats()
        with partial_state.PartialRankState(paths, src[0], SHAPES) as source:
            index = tensor_file.READ_STATS.bytes_read  # the small tensors (steps, the scale) read at opening
            stats = tensor_file.reset_read_stats()
            got = reshard.state_for_rank(_template(*dst, rank), source, *dst, rank, SHAPES)
        assert_same(got, expected)
        share = _share_bytes(*dst, rank, moment_dtype.itemsize)
        assert stats.bytes_read == share and index < 100  # exactly the rank's elements, each once
        assert stats.whole_files == 0 and share < total / dst[1] + 1024


def test_a_legacy_format_file_is_read_by_range_with_the_same_result(tmp_path):
    """checkpoint.checkpoint_serialization false writes torch's legacy format: its storages' offsets are found by
    walking its data section (8 bytes per storage), and each rank reads exactly its share, as from a zip file."""
    paths = _saved_ranks(tmp_path, 3, 2, legacy=True)
    merged = reshard.merge_rank_states(rank_optimizer_states(tmp_path, {}, 3, 2, False), 3, SHAPES)
    for rank in range(2):
        expected = reshard.state_for_rank(_template(3, 2, rank), merged, 3, 2, rank, SHAPES)
        tensor_file.reset_read_stats()
        with partial_state.PartialRankState(paths, 3, SHAPES) as source:
            index = tensor_file.READ_STATS.bytes_read
            stats = tensor_file.reset_read_stats()
            got = reshard.state_for_rank(_template(3, 2, rank), source, 3, 2, rank, SHAPES)
        assert_same(got, expected)
        assert stats.bytes_read == _share_bytes(3, 2, rank, 4) and index < 100 and stats.whole_files == 0


def test_a_legacy_file_that_cannot_be_ranged_is_read_whole_after_one_warning_naming_it(tmp_path, caplog):
    path = _saved_ranks(tmp_path, 3, 1, legacy=True)[0]
    data = bytearray(path.read_bytes())
    index = tensor_file.legacy_index(path)
    first = min(t.untyped_storage()._checkpoint_offset for t in tensor_file.tensors_in(index))
    data[first - 8:first] = (12345).to_bytes(8, "little")  # the first storage's element count, not the index's
    path.write_bytes(bytes(data))
    with pytest.raises(Exception, match="zero_pp_rank_0"):  # the whole load's own error, naming the file
        tensor_file.TensorFile(path)
    with pytest.raises(Exception, match="zero_pp_rank_0"):
        tensor_file.TensorFile(path)
    warned = [r.getMessage() for r in caplog.records if "read whole" in r.getMessage()]
    assert len(warned) == 1 and str(path) in warned[0] and "element count" in warned[0]


def test_a_zip64_file_with_a_record_past_4_gib_is_read_by_range(tmp_path):
    """Records over 4 GiB and offsets past 4 GiB (zip64: the sizes and offsets in extra fields) are read at the
    right bytes. The file is sparse (torch.save under skip_data seeks over the data: ~10 KB on disk) and the
    tensor it saves is a sparse file mapped, not memory; the values are then written into the holes."""
    import os
    import zipfile
    numel = (4 << 30) // 4 + 1024  # one fp32 record of 4 GiB + 4 KiB
    backing = tmp_path / "sparse.bin"
    with open(backing, "wb") as handle:
        handle.truncate(numel * 4)
    big = torch.from_file(str(backing), shared=True, size=numel, dtype=torch.float32)
    path = tmp_path / "zip64.pt"
    with torch.serialization.skip_data():
        torch.save({"big": big, "small": torch.zeros(8)}, path)
    del big
    backing.unlink()
    records = {info.filename.split("/", 1)[1]: info for info in zipfile.ZipFile(path).infolist()}
    assert records["data/0"].file_size > 1 << 32 and records["data/1"].header_offset > 1 << 32  # zip64 both ways
    with tensor_file.TensorFile(path) as file:
        big_meta, small_meta = file.objects["big"], file.objects["small"]
        past = 2**30 + 5  # element 2^30 + 5 of the big record: byte 4 GiB + 20 into it
        values, tail = torch.arange(16, dtype=torch.float32) + 0.5, torch.arange(8, dtype=torch.float32) - 3.25
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, values.numpy().tobytes(), big_meta.untyped_storage()._checkpoint_offset + past * 4)
            os.pwrite(fd, tail.numpy().tobytes(), small_meta.untyped_storage()._checkpoint_offset)
        finally:
            os.close(fd)
        stats = tensor_file.reset_read_stats()
        out = torch.full((20,), float("nan"))
        file.read(big_meta, past - 2, out)
        assert torch.equal(out, torch.cat([torch.zeros(2), values, torch.zeros(2)]))
        assert torch.equal(file.materialise(small_meta), tail)
        assert stats.bytes_read == (20 + 8) * 4  # those bytes only, not the 4 GiB record
    # the CRC32 check's own reader of the zip structure finds the same data offsets in the zip64 fields
    from dsrun.io.zip_crc import zip_entries
    fd = os.open(path, os.O_RDONLY)
    try:
        starts = {entry.name.split("/", 1)[1]: entry.data_start for entry in zip_entries(fd)}
    finally:
        os.close(fd)
    assert starts["data/0"] == big_meta.untyped_storage()._checkpoint_offset
    assert starts["data/1"] == small_meta.untyped_storage()._checkpoint_offset > 1 << 32


def test_a_truncated_file_is_an_error_naming_it(tmp_path):
    path = _saved_ranks(tmp_path, 3, 1)[0]
    with partial_state.PartialRankState([path], 3, SHAPES) as source:
        path.write_bytes(path.read_bytes()[:2000])  # cut after the index was read: inside the first tensors
        with pytest.raises(EOFError, match="truncated"):
            reshard.state_for_rank(_template(3, 1, 0), source, 3, 1, 0, SHAPES)


SLACK = 4096  # the small tensors of the saved files (each master's step, the loss scale), read whole

# --- the engine: ZeRO-3 with Adam, 1 -> 2 and 2 -> 1 ranks, and a universal folder ----------------------
def _full_read_state(engine, tag_dir):
    """What today's read-everything path loads into this rank (every saved rank's file merged)."""
    from dsrun import comm
    from dsrun.checkpoint.universal_checkpoint import is_universal, load_universal_state
    from dsrun.checkpoint.saved_tag import saved_world

    strategy = engine.strategy
    if is_universal(tag_dir):
        full = load_universal_state(tag_dir)
    elif not (tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt").is_file():  # stage 0: in the model states
        sd = torch.load(tag_dir / "mp_rank_00_model_states.pt", weights_only=True)
        full = reshard.merge_rank_states([sd["optimizer"]], 0, sd["param_shapes"])
    else:
        sd = torch.load(tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=True)
        world = saved_world(sd)
        full = reshard.merge_rank_states(rank_optimizer_states(tag_dir, sd, 3, world, False), 3, sd["param_shapes"])
    return reshard.state_for_rank(strategy.state_dict(), full, 3, engine.dp_world_size,
                                  comm.get_rank(engine.dp_group), strategy.checkpoint_param_shapes())


def _load_and_compare(engine, root, tag):
    """Load ``root/tag`` through the engine and check the state equals the full-read path's; (bytes read beyond
    the module's buffers, the rank's share in bytes, the saved optimizer files' bytes)."""
    stats = tensor_file.reset_read_stats()
    engine.load_checkpoint(str(root), tag=tag)
    read = stats.bytes_read
    live = engine.strategy.state_dict()
    expected = _full_read_state(engine, root / tag)
    assert_same(live["fp32_flat_groups"], expected["fp32_flat_groups"])
    assert_same(live["optimizer_state_dict"]["state"], expected["optimizer_state_dict"]["state"])
    share = sum(t.numel() for t in live["fp32_flat_groups"]) * 4 * 3  # fp32 master + Adam's two moments
    read -= sum(b.numel() * b.element_size() for b in engine.module.buffers())  # the model states' buffers, read
    return read, share, sum(p.stat().st_size for p in (root / tag).glob("*_states.pt"))


def _weights_only(root, tag, load_module_only=True):
    """A weights-only load of ``root/tag`` into a fresh ZeRO-3 engine: its masters must be bit for bit what
    zero_to_fp32's consolidated state dict cuts to (today's path, read whole), the optimizer state left as it
    was; (bytes read beyond the module's buffers, the rank's share of the fp32 masters in bytes)."""
    from dsrun import comm
    from dsrun.utils import zero_to_fp32 as z2f

    engine = make_engine(3)
    strategy = engine.strategy
    before = strategy.state_dict()["optimizer_state_dict"]["state"]
    stats = tensor_file.reset_read_stats()
    engine.load_checkpoint(str(root), tag=tag, load_module_only=load_module_only,
                           load_optimizer_states=load_module_only)  # either way: the weights only
    read = stats.bytes_read - sum(b.numel() * b.element_size() for b in engine.module.buffers())
    live = strategy.state_dict()
    full = reshard.fp32_as_full_state(z2f.get_fp32_state_dict_from_zero_checkpoint(str(root), tag))
    expected = reshard.state_for_rank(live, full, 3, engine.dp_world_size, comm.get_rank(engine.dp_group),
                                      strategy.checkpoint_param_shapes(), load_optimizer_states=False)
    assert_same(live["fp32_flat_groups"], expected["fp32_flat_groups"])
    assert_same(live["optimizer_state_dict"]["state"], before)
    share = sum(t.numel() for t in live["fp32_flat_groups"]) * 4
    engine.destroy()
    return read, share


def _two_ranks(rank, world, root):
    """1 -> 2 (the one-rank save and its universal folder), then a 2-rank save for the 2 -> 1 load."""
    engine = make_engine(3)
    out = {"reshard": _load_and_compare(engine, root, "global_step2")}
    out["weights"] = _weights_only(root, "global_step2")
    out["universal"] = _load_and_compare(make_engine(3), root, "global_step2_universal")
    from_stage0 = make_engine(3)  # a stage-0 save: its optimizer state is in the model states file
    out["stage0"] = _load_and_compare(from_stage0, root / "stage0", "global_step2")
    from_stage0.destroy()
    train(engine, 1, start=2)
    engine.save_checkpoint(str(root / "two"))
    return out


@pytest.mark.usefixtures("single_rank")
def test_a_zero3_reshard_reads_each_ranks_share_and_loads_what_the_full_read_loads(tmp_path):
    engine = make_engine(3)
    train(engine, 2)
    engine.save_checkpoint(str(tmp_path))
    ds_to_universal.main(ds_to_universal.parse_arguments(
        ["--input_folder", str(tmp_path / "global_step2"), "--output_folder", str(tmp_path / "global_step2_universal")]))
    stage0 = make_engine(0)
    train(stage0, 2)
    stage0.save_checkpoint(str(tmp_path / "stage0"))
    stage0.destroy()
    for rank, out in enumerate(run_ranks(_two_ranks, 2, tmp_path, timeout=240)):
        read, share, saved = out["stage0"]  # stage 0 -> 3 on 2 ranks: the rank's half of the model states' optimizer
        assert 0.9 * share <= read <= share + SLACK and share < 0.55 * saved
        read, share, saved = out["reshard"]
        assert 0.9 * share <= read <= share + SLACK and share < 0.55 * saved  # 1 -> 2: about half of the one saved file
        read, share, _ = out["universal"]
        assert 0.9 * share <= read <= share + SLACK
        read, share = out["weights"]  # weights only, 1 -> 2: the rank's half of the masters, never the whole model
        assert 0.9 * share <= read <= share + SLACK
    one = make_engine(3)
    read, share, saved = _load_and_compare(one, tmp_path / "two", "global_step3")
    assert 0.9 * share <= read <= share + SLACK and share < saved  # 2 -> 1: every element once, no file read twice
    read, share = _weights_only(tmp_path / "two", "global_step3", load_module_only=False)  # 2 -> 1, weights only
    assert 0.9 * share <= read <= share + SLACK
    # no optimizer to carry the masters (stage 0, inference): each parameter read into the module by range, the
    # values zero_to_fp32's; the rank reads the whole module's masters once (it holds the whole module)
    read, share = _into_a_module_without_optimizer(tmp_path / "two", "global_step3")
    assert 0.9 * share <= read <= share + SLACK


def _into_a_module_without_optimizer(root, tag):
    import dsrun
    from dsrun.utils import zero_to_fp32 as z2f
    from tests.harness.models import checkpoint_gpt
    from tests.harness.runs import checkpoint_config

    config = {k: v for k, v in checkpoint_config(0, "fp32", 4).items() if k not in ("optimizer", "scheduler")}
    engine, *_ = dsrun.initialize(model=checkpoint_gpt(0.0, False), config=config)
    assert engine.strategy is None
    stats = tensor_file.reset_read_stats()
    engine.load_checkpoint(str(root), tag=tag, load_module_only=True)
    read = stats.bytes_read - stats.module_bytes  # the placeholders and buffers read into the module
    full = z2f.get_fp32_state_dict_from_zero_checkpoint(str(root), tag)
    params = dict(engine.module.named_parameters())
    for name, value in params.items():
        assert_same(value.detach(), full[name].to(value.dtype), name)
    engine.destroy()
    return read, sum(v.numel() for v in params.values()) * 4


def test_a_pipeline_reshard_reads_each_stages_files_by_range_as_the_merge_of_the_stages(tmp_path):
    """Two saved pipeline stages (ZeRO-3 on 2 data ranks, ZeRO-2 on 1) naming the same parameters: the later stage's
    values win, as pipeline_state.merge_stages merges them, and a rank reads only its share of them."""
    from dsrun.checkpoint import pipeline_state

    _saved_ranks(tmp_path, 3, 2)
    for path in _saved_ranks(tmp_path / "later", 2, 1):
        path.rename(tmp_path / path.name.replace("mp_rank_00", "mp_rank_01"))
    slices = [{"param_shapes": SHAPES, "dsrun": {"zero_stage": 3}, "dp_world_size": 2},
              {"param_shapes": SHAPES, "dsrun": {"zero_stage": 2}, "dp_world_size": 1}]
    merged = pipeline_state.merge_stages(tmp_path, slices, False)
    _each_rank_reads_its_share_of_the_later_stage(tmp_path, slices, merged)


def _each_rank_reads_its_share_of_the_later_stage(folder, slices, merged):
    """Each of 2 ranks resharding ``folder``'s stages (as one stage over 2 data ranks) gets what the whole-file
    merge ``merged`` gives it, reading by range only its elements of the later stage's files."""
    for rank in range(2):
        expected = reshard.state_for_rank(_template(1, 2, rank), merged, 1, 2, rank, SHAPES)
        with partial_state.PartialStagesState(folder, slices, False) as source:
            stats = tensor_file.reset_read_stats()
            got = reshard.state_for_rank(_template(1, 2, rank), source, 1, 2, rank, SHAPES)
        assert_same(got, expected)
        assert stats.bytes_read == stats.range_bytes == _share_bytes(1, 2, rank, 4)


def _stage0_model_states(folder, name="mp_rank_00_model_states.pt", shapes=SHAPES, **extra):
    """A dsrun stage-0 save's model states file: its optimizer state (the flat masters and moments of
    ``_saved_ranks(.., 0, 1)``) inside, under ``optimizer``."""
    scratch = folder.parent / f".{folder.name}.{name}.scratch"
    osd = torch.load(_saved_ranks(scratch, 0, 1)[0], weights_only=True)["optimizer_state_dict"]
    torch.save({"module": OrderedDict(), "buffer_names": [], "optimizer": osd, "param_shapes": shapes,
                "dp_world_size": 1, "dsrun": {"zero_stage": 0}, **extra}, folder / name)
    return osd


def test_a_pipeline_stage_saved_at_zero_stage_0_is_read_by_range_as_the_merge_of_the_stages(tmp_path):
    """A pipeline stage saved at ZeRO stage 0 keeps its optimizer state in its model states file: opening the
    stages leaves it unread, a reshard reads the rank's ranges of it (the later stage's values win, as
    pipeline_state.merge_stages merges them), a load at the saved layout all of it."""
    from dsrun.checkpoint import pipeline_state

    _saved_ranks(tmp_path, 3, 2)
    torch.save({"module": None, "param_shapes": SHAPES, "dsrun": {"zero_stage": 3}, "dp_world_size": 2},
               tmp_path / "mp_rank_00_model_states.pt")
    osd = _stage0_model_states(tmp_path, "mp_rank_01_model_states.pt", module=None)
    stats = tensor_file.reset_read_stats()
    slices = pipeline_state.saved_slices(tmp_path)
    assert stats.bytes_read < 100 and partial_state.left_unread(slices[1])  # the stage-0 masters and moments: unread
    _each_rank_reads_its_share_of_the_later_stage(
        tmp_path, slices, pipeline_state.merge_stages(tmp_path, pipeline_state.saved_slices(tmp_path), False))
    own = pipeline_state.stage_optimizer_states(tmp_path, slices[1], 1, False)[0]  # the saved layout: whole
    assert_same(own["single_partition_of_fp32_groups"], osd["single_partition_of_fp32_groups"])
    assert_same(own["base_optimizer_state"], osd["base_optimizer_state"])


def _tag_folder(root, stage, world):
    """A checkpoint tag folder of ``SHAPES`` saved by ``world`` ranks at ``stage`` (its model states file with
    the module's placeholders at stage 3, the module's weights otherwise; a stage-0 save's optimizer inside)."""
    tag_dir = root / "global_step7"
    tag_dir.mkdir(parents=True)
    module = OrderedDict((n, torch.empty(0) if stage == 3 else torch.randn(s)) for g in SHAPES for n, s in g.items())
    states = {"module": module, "buffer_names": [], "param_shapes": SHAPES, "dp_world_size": world,
              "shared_params": {}, "dsrun": {"zero_stage": stage}}
    if stage == 0:
        _stage0_model_states(tag_dir, **{k: v for k, v in states.items() if k not in ("param_shapes", "dsrun")})
    else:
        _saved_ranks(tag_dir, stage, world)
        torch.save(states, tag_dir / ("zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3
                                      else "mp_rank_00_model_states.pt"))
    (root / "latest").write_text(tag_dir.name)
    return tag_dir


def _state_bytes(paths, stage):
    """The bytes of the masters and per-element optimizer states in the saved ZeRO state dicts ``paths``."""
    total = masters = 0
    for path in paths:
        sd = torch.load(path, weights_only=True)
        osd = sd["optimizer"] if stage == 0 else sd["optimizer_state_dict"]
        for master in osd["fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"]:
            masters += master.numel() * 4
        base = osd["optimizer_state_dict" if stage == 3 else "base_optimizer_state"]
        total += sum(v.numel() * v.element_size() for s in base["state"].values() for v in s.values() if v.dim())
    return masters, masters + total


@pytest.mark.parametrize("stage,world", [(3, 2), (2, 3), (0, 1)])
def test_the_universal_conversion_reads_each_element_once_one_parameter_at_a_time(tmp_path, monkeypatch, stage,
                                                                                    world):
    """ds_to_universal reads the saved state by range, parameter by parameter (never more than one parameter's
    state between two of its written folders), each element once, and writes what the merged read gives."""
    from dsrun.checkpoint import atomic, universal_checkpoint

    tag_dir = _tag_folder(tmp_path, stage, world)
    model_states = torch.load(next(tag_dir.glob("*model_states.pt")), weights_only=True)
    merged = reshard.merge_rank_states(rank_optimizer_states(tag_dir, model_states, stage, world, False), stage,
                                       SHAPES)
    between: list[int] = []  # bytes read since the previous parameter's master was written, at each
    real_save = atomic.save_torch

    def counting_save(obj, path, *args, **kwargs):
        if path.name == "fp32.pt":
            between.append(tensor_file.READ_STATS.range_bytes)
            tensor_file.READ_STATS.range_bytes = 0
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(atomic, "save_torch", counting_save)
    stats = tensor_file.reset_read_stats()
    out = ds_to_universal.ds_to_universal(str(tag_dir), str(tmp_path / "universal"), verbose=False)
    monkeypatch.undo()
    total = sum(between) + stats.range_bytes
    paths = list(tag_dir.glob("*optim_states.pt")) or list(tag_dir.glob("*model_states.pt"))
    elements = sum(math.prod(s) for g in SHAPES for s in g.values())
    assert total == elements * 12 and stats.whole_files == 0  # every element of the master and two moments, once
    assert total <= _state_bytes(paths, stage)[1]  # ... and not the padding
    largest = max(math.prod(s) for g in SHAPES for s in g.values()) * 12
    assert all(b <= largest for b in between)  # one parameter's state at a time (its master read before writing)
    got = universal_checkpoint.load_universal_state(out)
    assert_same(got.fp32, merged.fp32)
    assert_same(got.moments, merged.moments)
    assert_same(got.group_scalars, merged.group_scalars)
    assert got.param_groups == merged.param_groups
    universal_module = torch.load(out / "mp_rank_00_model_states.pt", weights_only=True)["module"]
    for name, value in universal_module.items():  # stage 3's placeholders: the masters; else the saved weights
        assert_same(value, merged.fp32[name].view(value.shape) if stage == 3 else model_states["module"][name])


@pytest.mark.parametrize("stage,world", [(3, 2), (1, 2), (0, 1)])
def test_zero_to_fp32_reads_only_the_master_weights(tmp_path, monkeypatch, stage, world):
    """zero_to_fp32 reads each file's index, then only the bytes of its fp32 masters: never the moments."""
    from dsrun.utils import zero_to_fp32 as z2f

    tag_dir = _tag_folder(tmp_path, stage, world)
    model_states = torch.load(next(tag_dir.glob("*model_states.pt")), weights_only=True)
    merged = reshard.merge_rank_states(rank_optimizer_states(tag_dir, model_states, stage, world, False), stage,
                                       SHAPES)
    read: list[int] = []
    real_read = z2f.read_saved

    def counting_read(path, tensor):
        out = real_read(path, tensor)
        if tensor.device.type == "meta":
            read.append(out.numel() * out.element_size())
        return out

    monkeypatch.setattr(z2f, "read_saved", counting_read)
    got = z2f.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    paths = list(tag_dir.glob("*optim_states.pt")) or list(tag_dir.glob("*model_states.pt"))
    masters, everything = _state_bytes(paths, stage)
    assert sum(read) == masters and masters < everything / 2  # (nor the module's weights: the masters replace them)
    assert set(got) == set(merged.fp32)
    for name, value in got.items():
        assert_same(value.reshape(-1), merged.fp32[name], name)


@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_deepspeeds_own_stage0_layout_reshards_with_its_optimizer_state_read_by_range(tmp_path, precision):
    """DeepSpeed's stage-0 file (no param_shapes; the torch optimizer's per-parameter state with the module's
    weights as masters, bf16's unfused wrapper, fp16's fused flat groups) loaded at ZeRO-3: the optimizer state
    comes with it, as converting the whole file gives it, and the rank reads exactly its elements by range."""
    from dsrun.checkpoint import load_file
    from dsrun.checkpoint.deepspeed_format import stage0_to_dsrun

    from .test_deepspeed_format import write_deepspeed_checkpoint

    engine = make_engine(0, precision)
    train(engine, 2)
    write_deepspeed_checkpoint(engine, tmp_path, "global_step2")
    fresh = make_engine(3, precision)
    shapes = fresh.strategy.checkpoint_param_shapes()
    saved = load_file(tmp_path / "global_step2" / "mp_rank_00_model_states.pt")
    full = reshard.merge_rank_states([stage0_to_dsrun(saved["optimizer"], shapes, saved["module"])], 0, shapes)
    expected = reshard.state_for_rank(fresh.strategy.state_dict(), full, 3, 1, 0, shapes)
    stats = tensor_file.reset_read_stats()
    fresh.load_checkpoint(str(tmp_path))
    live = fresh.strategy.state_dict()
    assert_same(live["fp32_flat_groups"], expected["fp32_flat_groups"])
    assert_same(live["optimizer_state_dict"]["state"], expected["optimizer_state_dict"]["state"])
    assert live["optimizer_state_dict"]["state"]  # the saved optimizer state, not a weights-only load
    elements = sum(s.length for group in master_slots(3, 1, 0, shapes)[0] for s in group)
    assert stats.range_bytes == elements * 12  # fp32 master + Adam's two moments, each element once


# --- the 1-bit optimizers' per-rank error buffers, re-cut for another world size ---------------------------
def test_onebit_error_buffers_are_recut_reading_only_what_the_rank_keeps(tmp_path, monkeypatch):
    """3 saved ranks -> 2: each new rank's worker error is the saved ranks' mean by name (every saved worker
    element is needed: read once each, a few elements at a time), its server error its own chunk of the saved
    servers' errors laid end to end (only that chunk read); bit for bit the whole-read arithmetic."""
    from dsrun.comm.compressed import CompressedLayout, merge_server_errors, split_server_error
    from dsrun.optim import rank_state
    from dsrun.optim.onebit.base import recut_errors, saved_places
    monkeypatch.setattr(rank_state, "MEAN_CHUNK_ELEMENTS", 37)  # several chunks per parameter
    saved_shapes = OrderedDict([("a", torch.Size([30, 5])), ("b", torch.Size([70])), ("c", torch.Size([9, 11]))])
    numel = sum(math.prod(s) for s in saved_shapes.values())
    saved_layout, gen = CompressedLayout.of(numel, 3), torch.Generator().manual_seed(3)
    paths = []
    for rank in range(3):
        path = tmp_path / f"optimizer_rank_states_{rank}.pt"
        torch.save({"optimizer": "OneBitAdam", "world_size": 3, "rank": rank, "param_shapes": [saved_shapes],
                    "chunks": [saved_layout.chunk], "worker_errors": [torch.randn(numel, generator=gen)],
                    "server_errors": [torch.randn(saved_layout.chunk, generator=gen)]}, path)
        paths.append(path)
    whole = [torch.load(p, weights_only=True) for p in paths]
    live_shapes = OrderedDict((name, saved_shapes[name]) for name in ("c", "a", "b"))  # another order
    live = CompressedLayout.of(numel, 2)
    # the whole-read arithmetic: every rank's buffers in memory, by name, stacked
    offsets = dict(zip(saved_shapes, [0, 150, 220]))
    full_server = merge_server_errors([s["server_errors"][0] for s in whole], numel)
    worker, server_flat, at = torch.zeros(live.numel), torch.zeros(live.numel), 0
    for name, shape in live_shapes.items():
        n, so = math.prod(shape), offsets[name]
        worker[at:at + n] = torch.stack([s["worker_errors"][0][so:so + n].clone() for s in whole]).mean(dim=0)
        server_flat[at:at + n] = full_server[so:so + n]
        at += n
    for rank in range(2):
        stats = tensor_file.reset_read_stats()
        with partial_state.PartialRankStates(paths) as saved:
            opened = stats.bytes_read
            got_worker, got_server = recut_errors(saved.states, saved_places(saved.states), live_shapes, live,
                                                  rank, saved.read)
        assert torch.equal(got_worker, worker)
        assert torch.equal(got_server, split_server_error(server_flat, live, rank))
        assert opened == 0 and stats.bytes_read == (3 * numel + live.valid(rank)) * 4  # each needed element once


class _NotAllowed:
    """A class no allow-list names."""


def test_a_legacy_file_holding_a_class_off_the_allow_list_is_refused_in_one_line(tmp_path):
    from dsrun.checkpoint.safe_load import UnsafeCheckpointError
    path = tmp_path / "unsafe.pt"
    torch.save({"x": torch.ones(3), "obj": _NotAllowed()}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafeCheckpointError, match="unsafe.pt: refusing to load"):
        tensor_file.TensorFile(path)


def test_a_module_read_in_place_loads_what_load_state_dict_loads(tmp_path):
    """Stages 0-2's in-place module read against load_state_dict of the whole file: a bf16 save into fp32 (the
    cast through one buffer), a tied weight read once, a shape mismatch refused with load_state_dict's error."""
    def net():
        torch.manual_seed(5)
        model = torch.nn.Sequential(torch.nn.Embedding(11, 6), torch.nn.Linear(6, 11), torch.nn.LayerNorm(11))
        model[1].weight = model[0].weight  # tied
        return model

    saved = net()
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": saved.to(torch.bfloat16).state_dict()}, path)  # the tie saved once
    expected, got = net(), net()
    expected.load_state_dict(tensor_file.load_file(path)["module"])
    for p in got.parameters():
        p.data.zero_()
    assert partial_state.reads_into(got)
    module = partial_state.model_states_without_parameters(path, set(), module_unread=True)["module"]
    assert all(t.device.type == "meta" for t in module.values())
    stats = tensor_file.reset_read_stats()
    got.load_state_dict(partial_state.read_module_into(got, module, path))
    assert_same(got.state_dict(), expected.state_dict())
    assert stats.module_bytes == sum(v.numel() * v.element_size() for k, v in module.items() if k != "1.weight")
    wrong = net()
    wrong[1] = torch.nn.Linear(6, 12)
    with pytest.raises(RuntimeError, match="size mismatch for 1.bias"):
        wrong.load_state_dict(partial_state.read_module_into(wrong, module, path))
    assert not partial_state.reads_into(torch.nn.Sequential(torch.nn.BatchNorm1d(3)))  # its own _load_from_state_dict
