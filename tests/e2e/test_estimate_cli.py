"""``dsrun estimate-memory`` as users run it: counts only, a recipe, --json, --measured, and mistakes."""
from __future__ import annotations

import json
import sys
import types

import psutil

import pytest
from omegaconf import OmegaConf

from dsrun.cli.__main__ import main
from tests.helpers import run_cli

ZERO2_COLD_ROWS = ["  127.45GB |   5.31GB | offload_optimizer=cpu ",
                   "  127.45GB |  15.93GB | offload_optimizer=none"]


def test_counts_only_prints_deepspeeds_tables_byte_for_byte():
    result = run_cli("estimate-memory", "--total-params", "2.851e9", "--largest-layer-params", "3.2e7",
                     "--gpus-per-node", "8", "--nodes", "1", env={"COLUMNS": "140"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    start = lines.index("Estimated memory needed for params, optim states and gradients for a:")
    assert lines[start + 1:start + 6] == ["HW: Setup with 1 node, 8 GPUs per node.",
                                          "SW: Model with 2851M total params.",
                                          "  per CPU  |  per GPU |   Options", *ZERO2_COLD_ROWS]
    assert "   71.69GB |   0.12GB | offload_param=cpu , offload_optimizer=cpu , zero_init=1" in lines
    assert "    1.43GB |   6.09GB | offload_param=none, offload_optimizer=none, zero_init=1" in lines
    assert "verdict for the recipe:" in result.stdout
    for option in ("none/none", "cpu/none", "nvme/nvme"):
        assert option in result.stdout


def test_json_output_is_one_document_for_machines():
    result = run_cli("estimate-memory", "--json", "--total-params", "1.3e9", "--gpus-per-node", "2",
                     "--n-layer", "24", "--n-embd", "2048", "--n-head", "16", "--vocab-size", "50304",
                     "--micro-batch", "2", "--seq-len", "1024", "--stage", "2", "--precision", "bf16")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["layout"] == {"nodes": 1, "ranks_per_node": 2, "world_size": 2}
    assert data["inputs"]["zero_stage"] == 2 and data["inputs"]["precision"] == "bf16"
    assert data["recipe"]["activations"] > 0
    assert len(data["options"]) == 12
    assert data["deepspeed"]["zero2"].splitlines()[2] == "SW: Model with 1300M total params."
    assert data["verdict"]["level"] in ("fits", "tight", "too big")


@pytest.mark.parametrize("args, message", [
    (["--measure", "--total-params", "1e9"], "--measure: needs a recipe to train"),
    (["--measure", "--measured", "x.json"], "either --measure or --measured"),
    (["+recipe=x", "--total-params", "1e9"], "either a recipe (overrides) or --total-params"),
    (["--largest-layer-params", "1e6"], "needs --total-params"),
    (["--total-params", "1e9", "--n-layer", "2"], "give all four"),
    (["--total-params", "-5"], "--total-params: must be a non-negative whole number"),
    (["--total-params", "1e9", "--optimizer", "Adamm"], "did you mean 'adam'"),
])
def test_mistakes_are_one_line_and_exit_2(args, message, capsys):
    assert main(["estimate-memory", *args]) == 2  # in-process: the dispatcher's own error path
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1


TINY = {"_target_": "tests.unit.estimate.tiny_gpt.TinyGPT", "vocab_size": 512, "block_size": 64, "n_layer": 2,
        "n_head": 4, "n_embd": 64}


@pytest.fixture
def fake_compose(monkeypatch):
    """Stand in for dsrun.compose.compose_runspec(overrides, recipes_dirs) -> DictConfig, which composes
    conf/ + recipes/; here a fixed RunSpec with the overrides applied as dotted keys."""
    calls = []

    def compose_runspec(overrides, recipes_dirs=()):
        calls.append((list(overrides), tuple(recipes_dirs)))
        base = OmegaConf.create({
            "model": dict(TINY), "data": {"seq_len": 64}, "train": {}, "launcher": {"runner": "local", "num_procs": 2},
            "ds": {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
                   "optimizer": {"type": "AdamW"}},
        })
        return OmegaConf.merge(base, OmegaConf.from_dotlist([o.lstrip("+") for o in overrides]))

    module = types.ModuleType("dsrun.compose")
    module.compose_runspec = compose_runspec
    monkeypatch.setitem(sys.modules, "dsrun.compose", module)
    return calls


def test_recipe_mode_composes_builds_on_meta_and_estimates(fake_compose, capsys):
    code = main(["estimate-memory", "ds.zero_optimization.stage=3", "--json", "launcher.num_procs=4",
                 "--recipes-dir", "/tmp/recipes"])
    assert code == 0
    assert fake_compose == [(["ds.zero_optimization.stage=3", "launcher.num_procs=4"], ("/tmp/recipes",))]
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["name"] == TINY["_target_"] and data["model"]["largest_layer_name"] == "wte"
    assert data["inputs"]["zero_stage"] == 3 and data["layout"]["world_size"] == 4
    assert data["sources"]["zero_stage"] == "ds.zero_optimization.stage"
    assert data["inputs"]["gpt_shape"]["n_layer"] == 2
    assert data["comm_per_step"]["gradient_op"] == "reduce_scatter" and data["comm_per_step"]["gather_bytes"] > 0
    # the idle rank's memory is measured on this host (a probe subprocess, cached) and counted
    assert data["sources"]["rank_runtime_bytes"].startswith("measured")
    assert data["recipe"]["rank_runtime"] > 50 * 2**20
    assert data["recipe"]["rank_peak"] >= data["recipe"]["peak_per_rank"] + data["recipe"]["rank_runtime"]
    # --refresh-runtime probes again (as --measure does) and the sources line says how old the figure is
    assert main(["estimate-memory", "ds.zero_optimization.stage=3", "--json", "--refresh-runtime"]) == 0
    assert json.loads(capsys.readouterr().out)["sources"]["rank_runtime_bytes"].endswith("(measured just now)")


def test_flags_override_the_recipe_and_say_so(fake_compose, capsys):
    assert main(["estimate-memory", "--json", "--stage", "1", "--gpus-per-node", "3", "--precision", "bf16",
                 "--rank-runtime", "3e8"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["inputs"]["zero_stage"], data["layout"]["ranks_per_node"]) == (1, 3)
    assert data["sources"]["zero_stage"] == "--stage" and data["inputs"]["precision"] == "bf16"


def test_ten_billion_parameter_recipe_end_to_end_without_its_weights(fake_compose, capsys):
    # Timing is not asserted (shared, noisy machine); docs/estimate.md records measured times.
    overrides = ["model.vocab_size=50304", "model.block_size=2048", "model.n_layer=50", "model.n_head=32",
                 "model.n_embd=4096", "data.seq_len=2048"]
    main(["estimate-memory", "--json"])  # warm imports, so RSS growth below is the model's alone
    capsys.readouterr()
    rss_before = psutil.Process().memory_info().rss
    assert main(["estimate-memory", *overrides]) == 0
    rss_growth = psutil.Process().memory_info().rss - rss_before
    out = capsys.readouterr().out
    assert "total 10,283,433,984 params" in out and "Estimated memory needed" in out
    assert rss_growth < 200 * 2**20, f"RSS grew by {rss_growth / 2**20:.0f} MiB"


def test_measured_peaks_are_compared_with_the_prediction(fake_compose, tmp_path, capsys):
    assert main(["estimate-memory", "--json", "--rank-runtime", "3e8"]) == 0
    predicted = json.loads(capsys.readouterr().out)["recipe"]["rank_peak"]
    measured = tmp_path / "peaks.json"
    measured.write_text(json.dumps({"peak_bytes_per_rank": {"0": predicted, "1": int(predicted / 1.25)}}))
    assert main(["estimate-memory", "--measured", str(measured), "--json", "--rank-runtime", "3e8"]) == 0
    rows = json.loads(capsys.readouterr().out)["measured"]
    assert [(r["rank"], r["error_pct"]) for r in rows] == [(0, 0.0), (1, 25.0)]
    assert main(["estimate-memory", "--measured", str(measured), "--rank-runtime", "3e8"]) == 0
    out = capsys.readouterr().out
    assert "predicted vs measured" in out and "+25.0%" in out


def test_without_compose_the_recipe_mode_explains_the_way_out(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "dsrun.compose", None)  # import fails, as before the lead's module lands
    assert main(["estimate-memory", "+recipe=gpt"]) == 2
    assert "pass --total-params" in capsys.readouterr().err


@pytest.fixture
def fake_train(monkeypatch):
    """Stand in for the `dsrun train` subprocess of --measure: each "rank" records its peak in the run
    directory the way dsrun.worker does (dsrun.estimate.measure.write_rank_peak)."""
    import subprocess

    from dsrun.estimate.measure import write_rank_peak

    state = {"calls": [], "peaks": {0: 150 * 2**20, 1: 160 * 2**20}, "returncode": 0}

    def run(command, **kwargs):
        state["calls"].append((command, kwargs))
        run_dir = next(a.split("=", 1)[1] for a in command if a.startswith("hydra.run.dir="))
        if state["returncode"] == 0:
            for rank, peak in state["peaks"].items():
                write_rank_peak(run_dir, rank, peak)
        return subprocess.CompletedProcess(command, state["returncode"], "", "Traceback\nRuntimeError: boom\n")

    monkeypatch.setattr(subprocess, "run", run)
    return state


def test_measure_trains_a_few_steps_and_compares_each_rank(fake_compose, fake_train, capsys):
    assert main(["estimate-memory", "+recipe=gpt_zero2", "--measure", "--measure-steps", "2", "--json",
                 "--rank-runtime", "3e8"]) == 0
    (command, kwargs), = fake_train["calls"]
    assert command[1:4] == ["-m", "dsrun", "train"] and "+recipe=gpt_zero2" in command
    assert "train.max_steps=2" in command and kwargs["env"]["MALLOC_MMAP_THRESHOLD_"]
    data = json.loads(capsys.readouterr().out)
    predicted = data["recipe"]["rank_peak"]  # on the CPU: the whole rank process, runtime included
    assert data["recipe"]["rank_runtime"] == 3 * 10**8 and predicted > data["recipe"]["peak_per_rank"]
    assert [(r["rank"], r["measured"], r["predicted"]) for r in data["measured"]] == [
        (0, 150 * 2**20, predicted), (1, 160 * 2**20, predicted)]


def test_measure_reports_a_failed_run_and_a_run_without_records(fake_compose, fake_train, capsys):
    fake_train["returncode"] = 1
    assert main(["estimate-memory", "--measure", "--rank-runtime", "3e8"]) == 2
    assert "failed with exit code 1" in capsys.readouterr().err
    fake_train["returncode"], fake_train["peaks"] = 0, {}
    assert main(["estimate-memory", "--measure", "--rank-runtime", "3e8"]) == 2
    assert "record_rank_peak" in capsys.readouterr().err


def test_a_pipelined_recipe_gets_one_estimate_per_stage():
    """``+recipe=gpt_pipe``: each stage's parameters (the tied token table on both ends) and the blocks whose
    activations 1F1B keeps alive there (stage s: its blocks x min(micro-batches, stages - s))."""
    from dsrun.compose import compose_runspec
    from dsrun.models.config import GPTConfig

    result = run_cli("estimate-memory", "--json", "+recipe=gpt_pipe")
    assert result.returncode == 0, result.stderr
    stages = json.loads(result.stdout)["pipeline_stages"]
    cfg = compose_runspec(["+recipe=gpt_pipe"])
    model = GPTConfig.from_kwargs({k: v for k, v in OmegaConf.to_container(cfg.model).items() if k != "_target_"})
    assert len(stages) == model.pipeline_stages == 2
    assert sum(s["params"] for s in stages) == model.num_parameters() + model.vocab_size * model.n_embd
    micro_batches = cfg.ds.gradient_accumulation_steps
    layers = [[int(i) for i in s["layers"].split("-")] for s in stages]  # first-last layer of each stage
    blocks = [sum(1 for i in range(lo, hi + 1) if 2 <= i < 2 + model.n_layer) for lo, hi in layers]
    assert [s["blocks_in_flight"] for s in stages] == [b * min(micro_batches, 2 - s) for s, b in enumerate(blocks)]
    assert all(s["peak"] >= s["model_states"] + s["activations"] for s in stages)
