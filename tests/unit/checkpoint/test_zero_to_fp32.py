"""The converter: the copy saved with a checkpoint runs with torch alone; the CLI; safetensors; errors; DeepSpeed's
current output (a folder, sharded past max_shard_size, with its index) and the older one-file forms."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import venv

import pytest
import torch

from dsrun.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict, get_fp32_state_dict_from_zero_checkpoint,
                                     load_state_dict_from_zero_checkpoint)
from tests.helpers import run_cli

from .conftest import make_engine, train

pytestmark = pytest.mark.usefixtures("single_rank")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, single_rank):
    root = tmp_path_factory.mktemp("ckpt")
    engine = make_engine(2, "bf16")
    train(engine, 2)
    engine.save_checkpoint(str(root))
    live = {k: v.clone() for k, v in engine.module.state_dict().items()}
    return root, live


def test_saved_script_runs_in_a_venv_without_dsrun(checkpoint, tmp_path):
    root, live = checkpoint
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(env_dir)
    python = str(env_dir / "bin" / "python")
    # torch from the system, added as a plain path: the system site-packages' own .pth hooks (an editable
    # dsrun install, for one) are not processed, so only what sits in that folder is importable
    site = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True,
                          text=True, check=True).stdout.strip()
    with open(os.path.join(site, "system_torch.pth"), "w") as fh:
        fh.write(os.path.dirname(os.path.dirname(torch.__file__)) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = subprocess.run([python, "-c", "import dsrun"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'dsrun'" in probe.stderr  # nothing of dsrun importable
    out = tmp_path / "pytorch_model.bin"
    done = subprocess.run([python, str(root / "zero_to_fp32.py"), str(root), str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Detected checkpoint of type zero stage 2, world_size: 1" in done.stdout
    sd = torch.load(out, weights_only=True)
    assert list(sd) == list(live)
    assert all(torch.equal(sd[k].to(torch.bfloat16), live[k]) for k in live)
    assert sd["lm_head.weight"].data_ptr() == sd["transformer.wte.weight"].data_ptr()


def test_cli_safetensors_stores_tied_weight_once(checkpoint, tmp_path):
    from safetensors import safe_open

    root, live = checkpoint
    out = tmp_path / "model.safetensors"
    done = run_cli("convert", "zero-to-fp32", str(root), str(out), "--safe-serialization")
    assert done.returncode == 0, done.stderr
    with safe_open(str(out), "pt") as fh:
        keys = set(fh.keys())
        shared = json.loads(fh.metadata()["dsrun_shared_params"])
        values = {k: fh.get_tensor(k) for k in keys}
    assert shared == {"lm_head.weight": "transformer.wte.weight"}
    assert keys == set(live) - {"lm_head.weight"}
    assert all(torch.equal(values[k].to(torch.bfloat16), live[k]) for k in keys)


def test_cli_errors_are_one_line(tmp_path):
    done = run_cli("convert", "zero-to-fp32", str(tmp_path), str(tmp_path / "x.bin"))
    assert done.returncode == 2
    assert "Unable to find 'latest'" in done.stderr and "Traceback" not in done.stderr
    done = run_cli("convert", "zero-to-fp32", str(tmp_path), str(tmp_path / "x.bin"), "--tag", "nope")
    assert done.returncode == 2 and "doesn't exist" in done.stderr


def test_api_load_into_a_fresh_model(checkpoint):
    from tests.harness.models import checkpoint_gpt

    root, live = checkpoint
    model = checkpoint_gpt(0.0)
    load_state_dict_from_zero_checkpoint(model, str(root))
    assert all(torch.equal(v.to(torch.bfloat16), live[k]) for k, v in model.state_dict().items())
    assert get_fp32_state_dict_from_zero_checkpoint(str(root), tag="global_step2").keys() == live.keys()


def test_missing_rank_file_is_reported(checkpoint, tmp_path):
    import shutil

    root, _ = checkpoint
    copy = tmp_path / "c"
    shutil.copytree(root, copy)
    (copy / "global_step2" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    (copy / "global_step2" / "extra_optim_states.pt").write_bytes(b"")
    with pytest.raises(Exception):
        get_fp32_state_dict_from_zero_checkpoint(str(copy))


def test_script_help_runs_standalone(checkpoint):
    root, _ = checkpoint
    done = subprocess.run([sys.executable, "-I", str(root / "zero_to_fp32.py"), "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "--safe_serialization" in done.stdout


def test_a_checkpoint_without_its_key_order_still_converts(checkpoint, tmp_path):
    """Older checkpoints have no ``state_dict_keys``; with an empty module copy too, the masters' order is used."""
    import shutil

    root, live = checkpoint
    copy = tmp_path / "old"
    shutil.copytree(root, copy)
    path = copy / "global_step2" / "mp_rank_00_model_states.pt"
    states = torch.load(path, weights_only=False)
    states["dsrun"].pop("state_dict_keys", None)
    states["module"] = {}
    torch.save(states, path)
    full = get_fp32_state_dict_from_zero_checkpoint(str(copy))
    trainable = {n for g in states["param_shapes"] for n in g}
    assert trainable and trainable <= set(full)
    for name in trainable:
        assert torch.equal(full[name].to(torch.bfloat16), live[name]), name


# --- DeepSpeed's current output: a folder, sharded past max_shard_size, with an index ---------------------------
def _deepspeed_split(state_dict, weights_name: str, max_shard_size):
    """DeepSpeed's own split (its zero_to_fp32.py): huggingface_hub's, over empty copies of the tensors, a tied
    alias sharing its source's copy."""
    from huggingface_hub import split_torch_state_dict_into_shards

    copies, empty = {}, {}
    for name, tensor in state_dict.items():
        empty[name] = copies.setdefault(id(tensor), torch.empty(tensor.shape, dtype=tensor.dtype))
    pattern = weights_name.replace(".bin", "{suffix}.bin").replace(".safetensors", "{suffix}.safetensors")
    return split_torch_state_dict_into_shards(empty, filename_pattern=pattern, max_shard_size=max_shard_size)


def _load(path):
    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, weights_only=True)


def test_a_folder_gets_deepspeeds_pytorch_model_bin(checkpoint, tmp_path):
    root, _ = checkpoint
    full = get_fp32_state_dict_from_zero_checkpoint(str(root))
    out = tmp_path / "fp32"
    assert convert_zero_checkpoint_to_fp32_state_dict(str(root), str(out)) == str(out)  # under 5GB: one file
    assert sorted(os.listdir(out)) == ["pytorch_model.bin"]
    saved = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert saved.keys() == full.keys() and all(torch.equal(saved[k], full[k]) for k in full)
    assert saved["lm_head.weight"].data_ptr() == saved["transformer.wte.weight"].data_ptr()
    lazy = get_fp32_state_dict_from_zero_checkpoint(str(root), lazy_mode=True)  # DeepSpeed's keyword: whole tensors
    assert all(torch.equal(lazy[k].contiguous(), full[k]) for k in full)


@pytest.mark.parametrize("safe", [False, True], ids=["torch", "safetensors"])
def test_past_max_shard_size_the_folder_holds_deepspeeds_shards_and_index(checkpoint, tmp_path, safe):
    root, _ = checkpoint
    full = get_fp32_state_dict_from_zero_checkpoint(str(root))
    total = sum(t.numel() * t.element_size() for t in {id(t): t for t in full.values()}.values())
    limit = f"{total // 3000}KB"  # about a third of the model: three or four shards
    out = tmp_path / "sharded"
    convert_zero_checkpoint_to_fp32_state_dict(str(root), str(out), max_shard_size=limit, safe_serialization=safe)
    weights, index_name = (("model.safetensors", "model.safetensors.index.json") if safe
                           else ("pytorch_model.bin", "pytorch_model.bin.index.json"))
    split = _deepspeed_split(full, weights, limit)
    assert split.is_sharded and len(split.filename_to_tensors) >= 3
    assert sorted(os.listdir(out)) == sorted([*split.filename_to_tensors, index_name])
    text = (out / index_name).read_text()
    index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    assert text == json.dumps(index, indent=2, sort_keys=True) + "\n"
    loaded = {}
    for name, keys in split.filename_to_tensors.items():
        shard = _load(out / name)
        stored = [k for k in keys if not (safe and k == "lm_head.weight")]  # safetensors: the alias is metadata
        assert sorted(shard) == sorted(stored), name
        loaded.update(shard)
    assert all(torch.equal(loaded[k], full[k]) for k in loaded) and len(loaded) == len(full) - safe
    if safe:
        from safetensors import safe_open

        tied_file = split.tensor_to_filename["lm_head.weight"]
        assert tied_file == split.tensor_to_filename["transformer.wte.weight"]
        with safe_open(str(out / tied_file), "pt") as fh:
            assert fh.metadata()["format"] == "pt"
            assert json.loads(fh.metadata()["dsrun_shared_params"]) == {"lm_head.weight": "transformer.wte.weight"}


def test_the_saved_script_writes_a_sharded_folder(checkpoint, tmp_path):
    root, _ = checkpoint
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(root / "zero_to_fp32.py"), str(root), str(out), "--max_shard_size",
                           "100KB"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    index = json.loads((out / "pytorch_model.bin.index.json").read_text())
    assert set(index["weight_map"].values()) == set(os.listdir(out)) - {"pytorch_model.bin.index.json"}
    full = get_fp32_state_dict_from_zero_checkpoint(str(root))
    assert sorted(index["weight_map"]) == sorted(full)


def test_the_older_one_file_forms_still_work(checkpoint, tmp_path):
    root, _ = checkpoint
    full = get_fp32_state_dict_from_zero_checkpoint(str(root), tag="global_step2")
    written = [
        convert_zero_checkpoint_to_fp32_state_dict(str(root), output_file=str(tmp_path / "a" / "weights")),
        convert_zero_checkpoint_to_fp32_state_dict(str(root), str(tmp_path / "b.bin"), "global_step2"),  # old: tag third
        convert_zero_checkpoint_to_fp32_state_dict(str(root), str(tmp_path / "c.pt"), tag="global_step2",
                                                   exclude_frozen_parameters=True, verbose=False),
        convert_zero_checkpoint_to_fp32_state_dict(str(root), str(tmp_path / "d.safetensors"), safe_serialization=True),
    ]
    assert written == [str(tmp_path / n) for n in ("a/weights", "b.bin", "c.pt", "d.safetensors")]
    for path in written:
        saved = _load(path)
        assert all(torch.equal(saved[k], full[k]) for k in saved) and set(full) - set(saved) <= {"lm_head.weight"}
    with pytest.raises(TypeError, match="output_dir"):
        convert_zero_checkpoint_to_fp32_state_dict(str(root))
    with pytest.raises(ValueError, match="Unit 'XB' not supported"):
        convert_zero_checkpoint_to_fp32_state_dict(str(root), str(tmp_path / "e"), max_shard_size="5XB")
