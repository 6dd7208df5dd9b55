"""Decoupled saves on one rank, in process: the snapshot (a host copy with the live object's sharing and bytes,
untouched by later in-place updates; each engine file's snapshot serializes to the live one's size), every save's record (synchronous ones too), a held background write
publishing only when it ends, and the ledger's verdict on ``checkpoint.writer``'s keys."""
from __future__ import annotations

import collections
import io
import threading
import warnings

import pytest
import torch

from dsrun.checkpoint import decoupled, layout
from dsrun.checkpoint.snapshot import Snapshot, host_copy
from dsrun.checkpoint.training import TrainingCheckpoints

from .test_training_hooks import _Loader


def test_the_snapshot_keeps_sharing_and_bytes_and_ignores_later_updates():
    flat = torch.arange(12.0)
    weight = torch.nn.Parameter(torch.ones(3))
    tied = torch.ones(4)
    live = collections.OrderedDict(views=[flat[:4].view(2, 2), flat[4:]], whole=(flat, torch.Size([2])),
                                   nested={"p": weight, "n": 3, "s": "x"}, ints=torch.tensor([1, 2]),
                                   tied=[tied, tied], placeholders=[torch.empty(0), torch.empty(0)])
    saved_live = io.BytesIO()
    torch.save(live, saved_live)
    snap = host_copy(live)
    with torch.no_grad():  # the next step's in-place updates
        flat.add_(100.0)
        weight.add_(1.0)
    assert snap["views"][0].tolist() == [[0.0, 1.0], [2.0, 3.0]] and snap["whole"][0][:3].tolist() == [0.0, 1.0, 2.0]
    assert isinstance(snap["nested"]["p"], torch.nn.Parameter) and snap["nested"]["p"].tolist() == [1.0, 1.0, 1.0]
    # the views still share one storage, so the file holds each element once, as the live object's would; a
    # tensor met twice is one object, two empty storages stay two (as torch.save counts them)
    assert snap["views"][1].untyped_storage().data_ptr() == snap["whole"][0].untyped_storage().data_ptr()
    assert snap["tied"][0] is snap["tied"][1] and snap["placeholders"][0] is not snap["placeholders"][1]
    saved_snap = io.BytesIO()
    torch.save(snap, saved_snap)
    assert len(saved_snap.getvalue()) == len(saved_live.getvalue())


def test_a_snapshot_of_several_files_copies_each_whatever_addresses_the_freed_ones_leave():
    """A save's files are captured one after the other, each object freed once copied: the next one's storages
    may take the same addresses, which must not make it the earlier copy."""
    snap, copies = Snapshot(), []
    for i in range(20):
        live = {"state": torch.full((64,), float(i), dtype=(torch.float32, torch.float64)[i % 2])}
        copies.append(snap(live))
        del live
    assert [c["state"][0].item() for c in copies] == [float(i) for i in range(20)]
    assert [c["state"].dtype for c in copies] == [(torch.float32, torch.float64)[i % 2] for i in range(20)]


@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize("stage", [0, 3])
def test_each_file_of_a_save_serializes_from_its_snapshot_to_the_same_size(stage, monkeypatch, tmp_path):
    from dsrun.checkpoint import atomic

    from .conftest import make_engine, train

    engine, sizes = make_engine(stage), []
    train(engine, 1)

    def measure(obj, path, rank=0, torn_point=None, pickle_module=None):
        extra = {} if pickle_module is None else {"pickle_module": pickle_module}
        live, snap = io.BytesIO(), io.BytesIO()
        torch.save(obj, live, **extra)
        torch.save(host_copy(obj), snap, **extra)
        sizes.append((path.name, len(live.getvalue()), len(snap.getvalue())))

    monkeypatch.setattr(atomic, "save_torch", measure)
    engine.save_checkpoint(str(tmp_path))
    assert sizes and all(live == snap for _, live, snap in sizes), sizes


@pytest.mark.usefixtures("single_rank")
def test_a_synchronous_save_is_recorded_with_its_time_and_bytes(tmp_path):
    from .conftest import make_engine, train

    engine = make_engine(1)
    hooks = TrainingCheckpoints(engine, _Loader(), tmp_path, save_interval=2, resume=None, keep_last=0)
    train(engine, 2)
    assert hooks.save_if_due(2)
    (record,) = hooks.records
    assert record.settled() and record.step == 2 and record.samples == engine.global_samples
    assert 0 < record.write_s <= record.blocking_s  # the save call; then the deletion of old checkpoints
    assert record.bytes == decoupled.folder_bytes(tmp_path / "checkpoints" / "global_step2") > 0
    assert [name for name, _, _ in record.events()] == ["Checkpoint/Samples/blocking_s", "Checkpoint/Samples/write_s",
                                                          "Checkpoint/Samples/bytes"]


@pytest.mark.usefixtures("single_rank")
def test_a_decoupled_save_is_published_only_when_its_write_ends(tmp_path):
    from .conftest import make_engine, train

    engine = make_engine(1, extra={"checkpoint": {"writer": {"decoupled": True}}})
    hooks = TrainingCheckpoints(engine, _Loader(), tmp_path, save_interval=1, resume=None, keep_last=1)
    root = tmp_path / "checkpoints"
    train(engine, 1)
    assert hooks.save_if_due(1)
    hooks.wait_for_writes()
    writer, release = decoupled.active(), threading.Event()
    writer.before_write = lambda job: release.wait()
    try:
        train(engine, 1, start=1)
        assert hooks.save_if_due(2)
        train(engine, 1, start=2)  # training goes on while step 2's write is held
        assert layout.read_latest(root) == "global_step1" and not hooks.records[-1].settled()
        assert layout.list_tags(root) == ["global_step1"]  # keep_last=1: the one `latest` names stays
    finally:
        release.set()
        writer.before_write = None
    hooks.wait_for_writes()
    assert layout.read_latest(root) == "global_step2" and layout.list_tags(root) == ["global_step2"]
    assert [r.step for r in hooks.records] == [1, 2]
    second = hooks.records[1]
    assert second.settled() and second.write_s > 0 and second.blocking_s > 0
    assert second.bytes == decoupled.folder_bytes(root / "global_step2")


def test_decoupled_acts_with_the_writer_keys_and_the_split_keys_are_refused_with_their_reason():
    from dsrun.config import validate_ds_config

    def problems(writer: dict) -> list:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return validate_ds_config({"train_micro_batch_size_per_gpu": 1, "checkpoint": {"writer": writer}})

    assert problems({"decoupled": True}) == [] and problems({}) == []
    assert problems({"decoupled": True, "type": "PYTHON", "io_buffer_double": False}) == []
    (refused,) = problems({"decoupled": True, "data_parallel": "replica"})
    assert refused.path == "checkpoint.writer.data_parallel" and "part files no loader reads" in refused.message


def test_captured_files_are_written_through_their_save_s_writer_and_format(tmp_path):
    """A decoupled save's files keep the writer and the format of the save that captured them: the writer thread
    writes them under the same two (the training thread's settings are its own)."""
    import zipfile

    from dsrun.checkpoint import atomic
    from dsrun.io import WriterSettings

    settings = WriterSettings(type="MOCK")
    with atomic.writing_with(settings), atomic.legacy_serialization(True), \
            atomic.capturing_writes(lambda obj: obj) as captured:
        atomic.save_torch({"w": torch.ones(3)}, tmp_path / "a.pt")
        atomic.save_torch({"w": torch.ones(3)}, tmp_path / "b.pt")
    assert [(f.writer, f.legacy) for f in captured] == [(settings, True)] * 2 and not list(tmp_path.iterdir())
    written = {}

    def writer_thread():  # what DecoupledWriter's thread does with each file; no settings of its own
        assert atomic.writer_in_effect() is None
        for pending in captured:
            with atomic.writing_with(pending.writer), atomic.legacy_serialization(pending.legacy):
                atomic.save_torch(pending.obj, pending.path)
            written[pending.path.name] = pending.path.stat().st_size

    thread = threading.Thread(target=writer_thread)
    thread.start()
    thread.join(timeout=60)
    assert written == {"a.pt": 0, "b.pt": 0}  # the mock writer's files are empty
    with atomic.legacy_serialization(True):  # and the format: legacy files are not zip archives
        atomic.save_torch({"w": torch.ones(3)}, tmp_path / "c.pt")
    assert not zipfile.is_zipfile(tmp_path / "c.pt") and torch.load(tmp_path / "c.pt")["w"].sum() == 3
