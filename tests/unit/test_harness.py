"""The multi-rank test harness itself (tests/harness): config merging, case selection, launches run once."""
from __future__ import annotations

from tests.harness.launch import Launch, Runs
from tests.harness.runs import Case, cases_at, ds_config, zero3_config


def test_ds_config_merges_sections_and_drops_none():
    cfg = ds_config(2, 2, 4, bucket=300, zero={"overlap_comm": True}, zero_optimization={"reduce_scatter": False},
                    bf16={"enabled": True}, gradient_clipping=None)
    assert cfg["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 300, "allgather_bucket_size": 400,
                                        "overlap_comm": True, "reduce_scatter": False}
    assert cfg["bf16"] == {"enabled": True} and "gradient_clipping" not in cfg
    assert cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] == 8
    z3 = zero3_config(3, 2, 1, zero={"stage3_prefetch_bucket_size": 0})["zero_optimization"]
    assert (z3["reduce_bucket_size"], z3["allgather_bucket_size"], z3["stage3_prefetch_bucket_size"]) == (700, 900, 0)
    assert "stage3_prefetch_bucket_size" not in zero3_config(0, 2, 1)["zero_optimization"]


def test_cases_are_selected_by_world_size():
    cases = [Case("a", "mlp", ds_config(0, 2, 1), worlds=(1, 2)), Case("b", "gpt", ds_config(1, 1, 4))]
    assert list(cases_at(cases, 2)) == ["a", "b"] and list(cases_at(cases, 1)) == ["a"]
    assert cases[1].global_size(3) == 12


def test_each_declared_launch_runs_once(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(Launch, "__call__", lambda self: calls.append(self.world) or [self.world])
    runs = Runs(lambda root: {"two": Launch(print, 2, (str(root),))}, tmp_path)
    assert runs["two"] == [2] and runs["two"] == [2] and calls == [2]
    assert runs.launches["two"].args == (str(tmp_path),)


def test_ds_config_can_leave_the_optimizer_to_the_client():
    assert ds_config(1, 2, 1)["optimizer"]["type"] == "AdamW"
    assert "optimizer" not in ds_config(1, 2, 1, client_optimizer=True)


def test_checkpoint_jobs_merge_zero_keys_and_derive_variants():
    from tests.harness.checkpoints import CheckpointJob
    from tests.harness.runs import checkpoint_config

    zero = checkpoint_config(3, "fp32", 2, zero={"sub_group_size": 2000})["zero_optimization"]
    assert (zero["sub_group_size"], zero["allgather_bucket_size"], zero["stage3_param_persistence_threshold"]) == \
        (2000, 2000, 0)
    job = CheckpointJob(stage=1, precision="fp32", steps=4, global_batch=4)
    assert job.but(steps=2, load="saved") == CheckpointJob(stage=1, precision="fp32", steps=2, global_batch=4,
                                                           load="saved")
    assert job.steps == 4 and job.load is None  # a record: the variant is a new one


def test_a_model_draws_its_global_batches_from_its_own_seeds():
    import torch

    from tests.harness.models import READERS_SEQ, READERS_VOCAB, global_batch

    want = torch.randint(0, READERS_VOCAB, (6, READERS_SEQ), generator=torch.Generator().manual_seed(900 + 3))
    assert torch.equal(global_batch("readers", 3, 6), want)


def test_expert_parameters_are_named_by_their_global_id():
    from tests.harness.models import global_expert_name

    local = "moe.deepspeed_moe.experts.deepspeed_experts.1.0.weight"
    assert global_expert_name(local, [2, 3]) == "moe.deepspeed_moe.experts.deepspeed_experts.3.0.weight"
    assert global_expert_name("inp.weight", [2, 3]) == "inp.weight"
