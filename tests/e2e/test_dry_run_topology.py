"""`dsrun train --dry-run` builds every rank's engine on torch's fake process group and prints its groups and
partitions: the same as a real run of the same recipe builds (each rank records its own in
``topology_rank<R>.json``, dsrun.workloads.topology)."""
import pytest

from dsrun.workloads import topology
from tests.helpers import free_port, run_cli

TINY = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "data.max_bytes=300000"]
ONE_STEP = ["train.max_steps=1", "train.eval_iters=1", "train.eval_interval=0", "train.save_interval=0"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["gpt_pipe", "gpt_moe"])
def test_dry_run_prints_the_groups_and_partitions_a_real_run_builds(tmp_path, recipe):
    common = [f"+recipe={recipe}", "launcher.num_procs=2", *TINY]
    (tmp_path / "dry").mkdir()
    (tmp_path / "real").mkdir()
    dry = run_cli("train", "--dry-run", *common, cwd=tmp_path / "dry", timeout=600)
    assert dry.returncode == 0, dry.stdout[-3000:] + dry.stderr[-3000:]
    assert "dry run: nothing launched" in dry.stdout
    real = run_cli("train", *common, *ONE_STEP, f"launcher.master_port={free_port()}", cwd=tmp_path / "real",
                   timeout=600)
    assert real.returncode == 0, real.stdout[-3000:] + real.stderr[-3000:]
    (dry_dir,) = (tmp_path / "dry").glob("outputs/*/*")
    (real_dir,) = (tmp_path / "real").glob("outputs/*/*")

    built, simulated = topology.load(real_dir), topology.load(dry_dir)
    assert [info["rank"] for info in built] == [0, 1]
    assert simulated == built
    for line in topology.lines(built):
        assert line in dry.stdout
    if recipe == "gpt_pipe":  # two stages of one data-parallel rank each
        assert [info["groups"]["pipe"] for info in built] == [[0, 1], [0, 1]]
        assert [info["pipeline"]["stage"] for info in built] == [0, 1]
        assert all(info["zero"]["partition_numels"] for info in built)
    else:  # one data-parallel group of 2 ranks, 8 experts split 4 + 4
        assert [info["groups"]["data"] for info in built] == [[0, 1], [0, 1]]
        assert [info["experts"][0] for info in built] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert "pipeline" not in built[0]
