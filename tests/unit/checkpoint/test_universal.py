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
