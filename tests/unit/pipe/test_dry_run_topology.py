"""``dsrun train --dry-run``'s rank simulation (dsrun.workloads.topology) in this process, on torch's fake
process group: a 2-stage pipeline on 4 ranks is laid out as DeepSpeed's PipeDataParallelTopology."""
from dsrun.compose import compose_runspec
from dsrun.workloads import topology

TINY = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2"]


def test_four_ranks_of_a_two_stage_pipeline_on_the_fake_backend():
    spec = compose_runspec(["+recipe=gpt_pipe", "launcher.num_procs=4", *TINY])
    ranks = topology.simulate(spec, [4])
    assert [info["rank"] for info in ranks] == [0, 1, 2, 3]
    assert [info["groups"]["pipe"] for info in ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [info["groups"]["data"] for info in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [info["pipeline"]["stage"] for info in ranks] == [0, 0, 1, 1]
    first, last = ranks[0]["pipeline"], ranks[2]["pipeline"]
    assert first["layers"][0][0] == 0 and first["layers"][0][1] == last["layers"][0][0]
    # ZeRO-1 inside each stage: the stage's parameters split over its 2 data-parallel ranks; the last stage's
    # copy of the tied token table (256 x 32) is stepped by its owner, the first stage, and left out
    assert ranks[0]["zero"]["partition_numels"] == ranks[1]["zero"]["partition_numels"] == [first["params"] // 2]
    assert ranks[2]["zero"]["partition_numels"] == ranks[3]["zero"]["partition_numels"]
    assert 2 * ranks[2]["zero"]["partition_numels"][0] + 256 * 32 == last["params"]
    lines = topology.lines(ranks)
    assert len(lines) == 8 and lines[0].startswith("rank 0") and "pipeline stage 0 layers 0-" in lines[1]
