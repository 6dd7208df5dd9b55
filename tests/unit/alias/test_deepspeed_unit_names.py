"""Names DeepSpeed's own unit tests import (issue 43 item 1), with DeepSpeed's behaviour, at DeepSpeed's paths."""
from __future__ import annotations

import importlib
import logging

import pytest
import torch

from tests.helpers import run_ranks


def _deepspeed(path: str):
    from dsrun.alias.paths import target_of

    return importlib.import_module(target_of(path))


def test_required_torch_version_compares_release_numbers():
    required_torch_version = _deepspeed("deepspeed.utils.torch").required_torch_version
    assert required_torch_version(min_version=1.0) and required_torch_version(min_version="2.0")
    assert not required_torch_version(min_version=99.0)
    assert not required_torch_version(max_version="1.13") and required_torch_version(max_version=99)
    assert required_torch_version(min_version=2.0, max_version=99) and not required_torch_version(1.0, 1.1)
    with pytest.raises(ValueError, match="min_version or a max_version"):
        required_torch_version()


def test_pinned_memory_tracker_counts_and_logs_each_doubled_milestone(caplog):
    tracker = _deepspeed("deepspeed.utils.pin_memory_tracker")
    gb = 1024**3
    tracker._tracker.reset()
    ds_logger = logging.getLogger("DeepSpeed")
    propagate, ds_logger.propagate = ds_logger.propagate, True
    try:
        with caplog.at_level(logging.INFO, logger="DeepSpeed"):
            tracker.track_pinned_memory(30 * gb)
            tracker.track_pinned_memory(100 * gb)  # 130 GB: crosses 32, 64 and 128 in one call
        assert (tracker._tracker._bytes, tracker._tracker._calls) == (130 * gb, 2)
        assert tracker._tracker._next_checkpoint == 256 * gb
        records = {id(r): r for r in caplog.records}.values()  # one record reaches caplog twice when another
        # test left the DeepSpeed logger propagating to a second capturing handler
        assert [r.message.split(":")[0] for r in records if "checkpoint" in r.message] == [
            f"[pinned-memory checkpoint] crossed {n}.000 GB" for n in (32, 64, 128)]
    finally:
        ds_logger.propagate = propagate
        tracker._tracker.reset()
    assert [tracker._fmt_bytes(n) for n in (512, 2048, 2**20, 3 * gb)] == ["512 B", "2.0 KB", "1.00 MB", "3.000 GB"]


def test_get_optim_files_lists_a_tag_folder_in_rank_order(tmp_path):
    from dsrun.utils.zero_to_fp32 import get_model_state_files, get_optim_files

    names = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(12)]
    for name in reversed(names):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert get_optim_files(str(tmp_path)) == [str(tmp_path / n) for n in names]  # rank 2 before rank 10
    assert get_model_state_files(str(tmp_path)) == [str(tmp_path / "mp_rank_00_model_states.pt")]
    with pytest.raises(FileNotFoundError, match="_optim_states.pt"):
        get_optim_files(str(tmp_path / "missing"))


def test_expert_parallel_ranks_follow_deepspeeds_layouts():
    from dsrun.moe.groups import _get_expert_parallel_ranks

    experts, replicas = _get_expert_parallel_ranks(16, tensor_parallel_size_=2, expert_parallel_size_=4)
    assert experts == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert replicas == [[0, 8], [2, 10], [4, 12], [6, 14], [1, 9], [3, 11], [5, 13], [7, 15]]
    # data before experts, two pipeline stages (values DeepSpeed 0.19.8 returns)
    experts, replicas = _get_expert_parallel_ranks(16, 1, 2, pipeline_parallel_size_=2,
                                                   use_data_before_expert_parallel_=True)
    assert experts == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert replicas == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    with pytest.raises(ValueError, match="not divisible by expert-parallel size 3"):
        _get_expert_parallel_ranks(8, 1, 3)


def test_prime_factors_and_prefix_sums():
    from dsrun.compat.runtime.utils import prefix_sum_inc
    from dsrun.pipe.topology import _prime_factors

    assert [_prime_factors(n) for n in (1, 2, 12, 97, 360)] == [[], [2], [2, 2, 3], [97], [2, 2, 2, 3, 3, 5]]
    with pytest.raises(ValueError, match="strictly positive"):
        _prime_factors(0)
    assert prefix_sum_inc([3, 4, 5]) == [3, 7, 12] and prefix_sum_inc([]) == []
    from dsrun.compat.runtime.utils import call_to_str

    assert [call_to_str("int"), call_to_str("f", 3, "jeff", val=3)] == ["int()", "f(3, 'jeff', val=3)"]


def test_utils_builder_casts_to_bytes_in_place_and_flattens():
    from op_builder import UtilsBuilder

    ops = UtilsBuilder().load()
    typed = torch.arange(6, dtype=torch.float16).view(2, 3)
    raw = ops.cast_to_byte_tensor(typed)
    assert raw.dtype == torch.uint8 and raw.numel() == 12 and raw.data_ptr() == typed.data_ptr()
    assert [t.numel() for t in ops.cast_to_byte_tensor([typed, typed.double()])] == [12, 48]
    flat = ops.flatten([typed, torch.ones(2)])
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 1, 1]
    assert [t.shape for t in ops.unflatten(flat, [typed, torch.ones(2)])] == [(2, 3), (2,)]
    assert _deepspeed("deepspeed.ops").__compatible_ops__["utils"]


def test_config_getters_read_the_raw_dict():
    from dsrun.compat.runtime.constants import GRADIENT_CLIPPING_DEFAULT, LOG_LEVEL_DEFAULT
    from dsrun.config.deepspeed_config import get_gradient_clipping, get_log_level
    from dsrun.precision.config import DeepSpeedFP16Config

    assert get_log_level({}) is LOG_LEVEL_DEFAULT is None and get_log_level({"log_level": "ERROR"}) == "ERROR"
    assert get_gradient_clipping({}) == GRADIENT_CLIPPING_DEFAULT == 1.0
    assert get_gradient_clipping({"gradient_clipping": 0.5}) == 0.5
    assert DeepSpeedFP16Config(enabled=True, loss_scale=0).dynamic_loss_scale
    # the dynamic scaler's window and floor: any number while unused (static scale, fp16 off), > 0 once it runs
    assert DeepSpeedFP16Config(enabled=True, loss_scale=128, loss_scale_window=-1).loss_scale_window == -1
    assert DeepSpeedFP16Config(enabled=False, min_loss_scale=-1).min_loss_scale == -1
    with pytest.raises(ValueError, match="min_loss_scale must be > 0"):
        DeepSpeedFP16Config(enabled=True, loss_scale=0, min_loss_scale=-1)
    assert _deepspeed("deepspeed.utils.timer").trim_mean([3.0, 1.0, 2.0], 0.1) == 2.0
    assert _deepspeed("deepspeed.utils.comms_logging").CommsLogger is not None


def _gather_partitions(rank: int, world: int) -> list[bool]:
    from dsrun import comm
    from dsrun.compat.runtime.utils import PartitionedTensor

    comm.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)  # every rank builds the same tensors
    checks = []
    for rows, cols in ((world * 4, 3), (world * 4 - 1, world + 1)):  # an even and an uneven cut
        full = torch.rand(rows, cols)
        part = PartitionedTensor(full, group=None)  # the world
        rebuilt = PartitionedTensor.from_meta(part.to_meta(), part.data(), part.group)
        checks += [torch.equal(part.full(), full), torch.equal(rebuilt.full(), full),
                   part.local_size()[0] == part.partition[rank + 1] - part.partition[rank]]
    from dsrun.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid

    grid = PipelineParallelGrid(PipeDataParallelTopology(num_pp=2, num_dp=1))
    checks += [grid._is_grid_valid(), grid.is_first_stage is (rank == 0), grid.is_last_stage is (rank == 1),
               grid.pp_group == [0, 1], grid.dp_group == [rank]]
    return checks


def test_partitioned_tensor_gathers_even_and_uneven_cuts_and_the_grid_checks_its_size():
    assert all(all(r) for r in run_ranks(_gather_partitions, 2))


def test_config_model_moves_deprecated_fields_and_drops_auto():
    from pydantic import Field, ValidationError

    DeepSpeedConfigModel = _deepspeed("deepspeed.runtime.config_utils").DeepSpeedConfigModel

    class Conf(DeepSpeedConfigModel):
        size: int = 0
        names_old: str | None = Field(None, json_schema_extra={"deprecated": True, "new_param": "names",
                                                               "new_param_fn": lambda x: [x]})
        names: list[str] | None = None
        alias_me: int = Field(0, alias="alias_me_too")

    assert Conf(names_old="DS").names == ["DS"] and Conf(size="auto").size == 0
    assert Conf(alias_me_too=3).alias_me == 3 == Conf(alias_me=3).alias_me
    with pytest.raises(AssertionError, match="together"):
        Conf(names=["DS"], names_old="DS")
    with pytest.raises(ValidationError):
        Conf(size_typo=1)
    with pytest.raises(ValidationError):
        Conf(strict=True, size="auto")


def test_rotary_embedding_rotates_pairs_of_halves_and_passes_the_rest():
    from dsrun.sequence.layer import apply_rotary_pos_emb

    t = torch.arange(1.0, 7.0).view(1, 6)  # rotate the first 4 features: halves [1, 2] and [3, 4]
    angle = torch.tensor([[0.0, torch.pi / 2, 0.0, torch.pi / 2]])
    out = apply_rotary_pos_emb(t, angle.cos(), angle.sin())
    # feature 0 keeps its angle 0; feature 1 (angle 90 deg) becomes -(its partner 4); 3 keeps; 4 becomes 2
    assert torch.allclose(out, torch.tensor([[1.0, -4.0, 3.0, 2.0, 5.0, 6.0]]), atol=1e-6)


def test_model_checkpoint_name_for_rank():
    from dsrun.checkpoint.utils import get_model_ckpt_name_for_rank

    assert get_model_ckpt_name_for_rank("ckpt/global_step3", "01") == "ckpt/global_step3/mp_rank_01_model_states.pt"


@pytest.mark.parametrize("fp16", [{"loss_scale": True}, {"loss_scale": float("inf")}, {"loss_scale": []},
                                  {"enabled": True, "loss_scale_window": 0}, {"enabled": True, "min_loss_scale": 0},
                                  {"enabled": True, "loss_scale_window": False}])
def test_fp16_section_refuses_what_deepspeed_0_19_refuses(fp16):
    from pydantic import ValidationError

    from dsrun.config.precision import FP16Config

    with pytest.raises(ValidationError, match="fp16"):
        FP16Config(**fp16)
    assert FP16Config(enabled=True, loss_scale=128, loss_scale_window=0).loss_scale == 128  # unused by a static scale


def test_comms_logger_switches_what_it_profiles():
    from dsrun.comm.logger import CommsLogger

    logger = CommsLogger()
    logger.configure(enabled=True, prof_all=False)
    logger.start_profiling_op(["all_reduce", "broadcast"])
    assert logger.timing("all_reduce") and not logger.timing("all_gather")
    logger.stop_profiling_op(["all_reduce"])
    assert logger.prof_ops == ["broadcast"] and not logger.timing("all_reduce")
    logger.start_profiling_comms()
    assert logger.prof_all and logger.timing("all_gather")
    logger.stop_profiling_comms()
    assert logger.prof_all is False and not logger.timing("all_gather")


def test_inference_moe_flag_becomes_its_section():
    from dsrun.inference.config import DeepSpeedInferenceConfig, DeepSpeedMoEConfig

    for flag in (True, False):
        config = DeepSpeedInferenceConfig(moe=flag)
        assert isinstance(config.moe, DeepSpeedMoEConfig) and config.moe.enabled is flag is config.moe_enabled


def test_torch_checkpoint_engine_round_trips_a_file_in_the_format_deepspeed_writes(tmp_path):
    import zipfile

    engines = _deepspeed("deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine")
    state = {"w": torch.arange(6.0).view(2, 3), "step": 3}
    legacy, zipped = engines.TorchCheckpointEngine(), engines.TorchCheckpointEngine(
        type("Config", (), {"checkpoint_config": {}})())  # DeepSpeed's config object: zip-file format by default
    for engine, name in ((legacy, "legacy.pt"), (zipped, "zip.pt")):
        engine.save(state, str(tmp_path / name))
        loaded = engine.load(str(tmp_path / name))
        assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
    assert not zipfile.is_zipfile(tmp_path / "legacy.pt") and zipfile.is_zipfile(tmp_path / "zip.pt")
    info = _deepspeed("deepspeed.runtime.checkpoint_engine").CheckpointCommitInfo("tag", str(tmp_path), True)
    assert legacy.commit(info) is True and legacy.is_data_parallel_writer(0) and not legacy.is_data_parallel_writer(1)


def test_zenflow_names_split_cores_as_deepspeed():
    split = _deepspeed("deepspeed.runtime.zenflow.zenflow_utils")._split_affinity
    assert split([0, 1, 2, 3, 4, 5, 6, 7], 0.1) == ([1, 2, 3, 4, 5, 6, 7], [0])  # ceil(0.8) = 1 core trains
    assert split([10, 11], 0.5) == ([11], [10])
    assert split([3, 1, 2], 0.0) == ([3, 1, 2], [3, 1, 2])  # nothing to isolate: both share every core, in order
    config = _deepspeed("deepspeed.runtime.zero.config").DeepSpeedZeroConfig(stage=2, zenflow={"topk_ratio": 0.25})
    assert isinstance(config.zenflow, _deepspeed("deepspeed.runtime.zenflow.zenflow_config").ZenFlowConfig)
    assert _deepspeed("deepspeed.runtime.swap_tensor").MIN_SWAPPABLE_BYTES == 1024 ** 2


def test_autotuner_plans_deepspeeds_resources_and_tunes_through_dsrun_launch(tmp_path, monkeypatch):
    import json
    import subprocess

    from dsrun.cli.deepspeed_runner import parse_args

    api = _deepspeed("deepspeed.autotuning.autotuner")
    assert api is _deepspeed("deepspeed.autotuning.scheduler") is _deepspeed("deepspeed.autotuning.utils")
    exp = {"optimizer": {"type": "Adam"}, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    assert api.get_val_by_key(exp, "device") == "cpu" and api.get_val_by_key(exp, "missing") is None
    api.set_val_by_key(exp, "device", "nvme")
    assert exp["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
    rm = api.ResourceManager(None, ["w0"], 4, None, None, {" train_batch_size ": " -tbs ", "train_batch_size": "-x"})
    assert rm.arg_mappings == {"train_batch_size": "-tbs"} and rm.nodes[0].reserve_slots(3) == [0, 1, 2]
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"autotuning": {"enabled": True, "exps_dir": str(tmp_path / "exps"),
                                                 "results_dir": str(tmp_path / "results")}}))
    args = parse_args(["--autotuning", "tune", "--num_gpus", "2", "train.py", "--deepspeed_config", str(config)])
    tuner = api.Autotuner(args, {"w0": [0, 1, 2, 3], "w1": [0, 1, 2]})
    assert (tuner.exp_num_nodes, tuner.exp_num_gpus, tuner.rm.num_gpus_per_node) == (2, 2, 3)
    assert (tmp_path / "exps").is_dir() and (tmp_path / "results").is_dir()
    ran = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    (tmp_path / "results" / "cmd_optimal.txt").write_text("python train.py --deepspeed_config best.json")
    tuner.tune()
    assert ran[0][2:] == ["dsrun", "launch", "--autotuning", "tune", "--num_nodes", "2", "--num_gpus", "2",
                          "train.py", "--deepspeed_config", str(config)]
    assert tuner.run_after_tuning() == 0 and ran[1] == ["python", "train.py", "--deepspeed_config", "best.json"]
    with pytest.raises(Exception, match="--num_gpus"):
        api.Autotuner(parse_args(["--num_gpus", "8", "train.py", "--deepspeed_config", str(config)]), {"w0": [0]})


def test_fused_lion_is_the_cpu_lion_kernel_with_deepspeeds_signature():
    lion = _deepspeed("deepspeed.ops.lion")
    torch.manual_seed(0)
    fused, cpu = torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.randn(300))
    cpu.data.copy_(fused.data)
    a, b = lion.FusedLion([fused], lr=0.01, weight_decay=0.1), lion.DeepSpeedCPULion([cpu], lr=0.01, weight_decay=0.1)
    for _ in range(3):
        grad = torch.randn(300)
        fused.grad, cpu.grad = grad.clone(), grad.clone()
        a.step()
        b.step()
    assert torch.equal(fused, cpu)  # the same kernel on the same values
    a.zero_grad()
    keep = lion.FusedLion([cpu], set_grad_none=False)
    keep.zero_grad()
    assert fused.grad is None and torch.equal(cpu.grad, torch.zeros(300))
