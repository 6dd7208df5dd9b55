"""``benchmarks/gpu_check.py``, the one-GPU check, without a GPU: its ``--smoke`` run of two sections on the CPU
(the JSON a GPU run writes, the tables it prints), and its time box, failure and budget handling with stand-in
sections. The parity and compile sections run in the full ``--smoke`` (docs/performance.md), not here."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_smoke_writes_the_mfu_and_fsdp2_rows_and_prints_their_tables(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--smoke", "--only",
                           "mfu,vs_fsdp2", "--budget", "200", "--box-scale", "6", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)  # sections' boxes scaled for a busy CI
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["schema"] == "dsrun.gpu_check/1" and report["smoke"] is True
    sections = report["sections"]
    assert list(sections) == ["env", "parity", "mfu", "vs_fsdp2", "compile"]
    assert sections["parity"] == sections["compile"] == {"status": "skipped", "reason": "not in --only", "rows": []}
    (env,) = sections["env"]["rows"]
    assert env["backend"] == "gloo" and env["missing_modules"] == []

    assert sections["mfu"]["status"] == "ok", sections["mfu"]
    from dsrun.models.accounting import model_step_flops
    from dsrun.models.config import GPTConfig

    for row, stage in zip(sections["mfu"]["rows"], (0, 3), strict=True):
        assert row["stage"] == stage and row["peak_source"] == "measured"
        shape = {k: row[k] for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")}
        assert row["flops_per_step"] == model_step_flops(GPTConfig(**shape), row["micro"], row["seq"])
        assert 0 < row["mfu"] < 1 and 0 < row["engine_mfu"] < 1 and row["step_s"] > 0

    fsdp = sections["vs_fsdp2"]
    assert fsdp["status"] == "ok", fsdp
    assert [row["case"] for row in fsdp["rows"]] == ["torch", "dsrun_zero0", "dsrun_zero1", "dsrun_zero2",
                                                     "dsrun_zero3", "fsdp2"]
    assert all(row["step_s"] > 0 for row in fsdp["rows"])
    steps = {row["case"]: row["step_s"] for row in fsdp["rows"]}
    assert fsdp["summary"]["zero3_vs_fsdp2"] == round(steps["dsrun_zero3"] / steps["fsdp2"], 3)
    assert fsdp["summary"]["zero3_vs_zero0"] == round(steps["dsrun_zero3"] / steps["dsrun_zero0"], 3)
    assert "| fsdp2 | " in done.stdout and "| stage3/micro2 | " in done.stdout
    assert "| compile | skipped | - | not in --only |" in done.stdout


def test_a_section_is_time_boxed_its_failure_reported_and_skipped_without_budget(monkeypatch):
    gpu_check = load_gpu_check()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)

    def slow(section):
        section.emit({"case": "first", "step_s": 1.0})
        time.sleep(60)

    def broken(section):
        raise RuntimeError("no such kernel")

    monkeypatch.setitem(gpu_check.SECTIONS, "slow", (slow, (0, 0), (1.5, 1.5)))
    monkeypatch.setitem(gpu_check.SECTIONS, "broken", (broken, (0, 0), (30, 30)))
    monkeypatch.setitem(gpu_check.SECTIONS, "hungry", (broken, (100, 100), (300, 300)))
    started = time.monotonic()
    timed_out = gpu_check.run_section("slow", True, started, budget=60)
    assert timed_out["status"] == "timed_out" and timed_out["reason"] == "killed after its time box of 1.5 s"
    assert timed_out["rows"] == [{"case": "first", "step_s": 1.0}]  # what it finished is kept
    assert time.monotonic() - started < 20
    scaled = gpu_check.run_section("slow", True, time.monotonic(), budget=60, box_scale=2.0)
    assert scaled["reason"] == "killed after its time box of 3.0 s"  # --box-scale: a busy machine's longer boxes

    failed = gpu_check.run_section("broken", True, started, budget=60)
    assert failed["status"] == "failed" and failed["reason"] == "RuntimeError: no such kernel"
    assert "broken" in failed["traceback"]

    skipped = gpu_check.run_section("hungry", True, time.monotonic(), budget=60)
    assert skipped["status"] == "skipped" and skipped["reason"].startswith("budget: 60 s of 60 s left, needs ~100 s")

    table = gpu_check.tables({"smoke": True, "budget_s": 60, "elapsed_s": 3.0,
                              "sections": {"slow": timed_out, "broken": failed, "hungry": skipped}})
    assert "| broken | failed | " in table and "| hungry | skipped | - | budget: 60 s" in table


def test_an_unknown_section_is_refused(capsys):
    with pytest.raises(SystemExit) as stop:
        load_gpu_check().main(["--only", "nope"])
    assert stop.value.code == 2 and "unknown section(s) ['nope']" in capsys.readouterr().err
