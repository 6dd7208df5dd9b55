"""A config that enables what dsrun does not implement, as a user meets it (issue 18's acceptance): every entry
point refuses it the same way, one line per key, exit code 2, before any rank starts; with
``dsrun_allow_unimplemented: true`` it trains, and each key is warned about once."""
import json
import re
from pathlib import Path

from tests.helpers import free_port, run_cli

FEATURES = {  # what dsrun does not implement (yet); the features that act now are in tests/unit/config/
    "aio": {"use_gds": True},
    "graph_harvesting": True,
    "nebula": {"enabled": True},
}
KEYS = {"aio.use_gds", "graph_harvesting", "nebula.enabled"}
SHORT = ["train.max_steps=2", "train.eval_iters=1", "train.eval_interval=0", "data.max_bytes=200000"]


def refused(stderr: str) -> set[str]:
    keys = set()
    for line in stderr.splitlines():
        match = re.match(r"error: (?:ds\.)?(\S+): not implemented in this version of dsrun", line)
        if match:
            keys.add(match.group(1))
    return keys


def test_every_entry_point_refuses_the_same_keys_before_any_rank_starts(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, **FEATURES}))
    script = tmp_path / "train.py"
    marker = tmp_path / "started"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    results = {
        "validate": run_cli("config", "--validate", str(config)),
        "dry-run": run_cli("train", "--dry-run", f"ds_config={config}", cwd=tmp_path),
        "launch": run_cli("launch", "--num_procs", "1", str(script), "--deepspeed_config", str(config), cwd=tmp_path),
        "initialize": run_cli("launch", "--num_procs", "1", "--module", "tests.e2e._initialize_script",
                              str(config), cwd=tmp_path),
    }
    for name, result in list(results.items())[:3]:
        assert result.returncode == 2, (name, result.stderr)
        assert refused(result.stderr) == KEYS, (name, result.stderr)
        assert "Traceback" not in result.stderr
    assert not marker.exists() and not (tmp_path / "outputs").exists()  # nothing started, no run directory
    assert "refused: " + ", ".join(sorted(KEYS)) in results["initialize"].stdout, results["initialize"].stderr


def test_allowed_config_trains_with_one_warning_line_per_key(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({**FEATURES, "dsrun_allow_unimplemented": True}))
    result = run_cli("train", f"ds_config={config}", *SHORT, f"launcher.master_port={free_port()}", cwd=tmp_path,
                     timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    for key in KEYS:  # printed by dsrun train; the ranks it launched do not repeat it
        assert output.count(f"warning: ds.{key}: not implemented in this version of dsrun") == 1, (key, output[-3000:])
    assert list(Path(tmp_path).glob("outputs/*/*/metrics.json"))
