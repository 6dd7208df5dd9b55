"""DeepSpeed's autotuner objects (``deepspeed.autotuning.autotuner``, ``.scheduler``, ``.utils``) over dsrun's tuner.

DeepSpeed's launcher runs ``deepspeed --autotuning tune|run SCRIPT ARGS`` as ``Autotuner(args, active_resources)``
then ``tune()``, ``print_tuning_results()``, ``write_optimal_config()`` and, for ``run``, ``run_after_tuning()``.
Here the object takes the same inputs and plans the same resources (the hosts, the slots per node, the experiment
size from ``--num_nodes``/``--num_gpus``, the ``autotuning`` section of the script's config, its directories and
``arg_mappings``), and its ``tune()`` runs dsrun's own tuner on the script: ``dsrun launch --autotuning tune`` with
the same flags (:mod:`dsrun.autotuning.script`, docs/autotuning.md "Tuning a script"), which writes DeepSpeed's
result files (``summary.txt``, ``ds_config_optimal.json``, ``cmd_optimal.txt``) in the results directory.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from argparse import Namespace
from pathlib import Path
from typing import Mapping, Sequence

from dsrun.config import ds_section
from dsrun.utils.errors import Problem, UserError


def get_val_by_key(d: dict, k: str) -> object:
    """The value of key ``k`` in ``d`` or in any dict nested in it (depth first, ``d`` itself first); None when
    absent: a config key found wherever its section puts it."""
    if k in d:
        return d[k]
    for value in d.values():
        if isinstance(value, dict):
            found = get_val_by_key(value, k)
            if found is not None:
                return found
    return None


def set_val_by_key(d: dict, k: str, vv: object) -> None:
    """Set key ``k`` to ``vv`` wherever it already is in ``d`` and every dict nested in it."""
    if k in d:
        d[k] = vv
    for value in d.values():
        if isinstance(value, dict):
            set_val_by_key(value, k, vv)


class Node:
    """One host of the experiments and its free accelerator slots."""

    def __init__(self, host: str, max_slots: int):
        self.host = host
        self.max_slots = max_slots
        self.idle_slots = list(range(max_slots))

    def reserve_slots(self, slot_request: int) -> list[int] | None:
        """``slot_request`` free slots (the lowest), or None when fewer are free."""
        if len(self.idle_slots) < slot_request:
            return None
        reserved, self.idle_slots = self.idle_slots[:slot_request], self.idle_slots[slot_request:]
        return reserved

    def restore_slots(self, slots: list[int]) -> None:
        self.idle_slots += slots


class ResourceManager:
    """The hosts and slots experiments run on, and the script flags the tuned config keys map to
    (``arg_mappings``: config key -> the script's flag, both stripped of spaces; the first of a key wins)."""

    def __init__(self, args: Namespace | None, hosts: Sequence[str], num_gpus_per_node: int, results_dir: str | None,
                 exps_dir: str | None, arg_mappings: Mapping[str, str] | None):
        self.args = args
        self.results_dir = results_dir
        self.exps_dir = exps_dir
        self.num_gpus_per_node = num_gpus_per_node
        self.nodes = [Node(host, num_gpus_per_node) for host in hosts]
        self.arg_mappings: dict[str, str] = {}
        for key, flag in (arg_mappings or {}).items():
            self.arg_mappings.setdefault(key.strip(), flag.strip())


def _user_config_path(user_args: Sequence[str]) -> str | None:
    """The script's DeepSpeed config file: the value of ``--deepspeed_config`` (which must name a ``.json``), else
    of ``--deepspeed`` when it is a ``.json``; as DeepSpeed's autotuner reads it."""
    args = list(user_args)
    if "--deepspeed_config" in args:
        at = args.index("--deepspeed_config") + 1
        path = args[at] if at < len(args) else ""
        if ".json" not in path:
            raise UserError(Problem("--deepspeed_config", f"names {path!r}", "give the config as a .json file"))
        return path
    if "--deepspeed" in args and args.index("--deepspeed") + 1 < len(args):
        path = args[args.index("--deepspeed") + 1]
        return path if ".json" in path else None
    return None


class Autotuner:
    """DeepSpeed's ``Autotuner(args, active_resources)``: ``args`` as the ``deepspeed`` launcher parses them
    (``deepspeed.launcher.runner.parse_args``: the script and its arguments, ``--num_nodes``, ``--num_gpus``;
    DeepSpeed's own names ``user_script``/``user_args``/``num_gpus`` are read too), ``active_resources`` the
    ``{host: [slot, ...]}`` it may use."""

    def __init__(self, args: Namespace, active_resources: Mapping[str, Sequence[int]]):
        self.args = args
        self.selected_exp_dir = None
        self.user_script = getattr(args, "user_script", None) or getattr(args, "script", None)
        self.user_args = list(getattr(args, "user_args", None) or getattr(args, "script_args", None) or [])
        path = _user_config_path(self.user_args)
        if path is None:
            raise UserError(Problem("--autotuning", "the script's arguments name no DeepSpeed config",
                                    "pass it as --deepspeed_config ds_config.json"))
        if not os.path.isfile(path):
            raise UserError(Problem("--deepspeed_config", f"{path} is not an existing file"))
        self.user_config = json.loads(Path(path).read_text())
        self.autotuning_config = ds_section(self.user_config, "autotuning")
        section = self.user_config.get("autotuning") or {}
        for key in ("exps_dir", "results_dir"):  # the experiments' configs must not carry them on
            section.pop(key, None)
        self.exps_dir = self.autotuning_config.exps_dir
        self.results_dir = self.autotuning_config.results_dir
        for directory in (self.exps_dir, self.results_dir):
            if self.autotuning_config.overwrite and os.path.exists(directory):
                shutil.rmtree(directory, ignore_errors=True)
            os.makedirs(directory, exist_ok=True)
        self.rm = self._get_resource_manager(active_resources)
        self.exp_num_nodes, self.exp_num_gpus = self._get_exp_resources(args)
        if self.exp_num_gpus > self.rm.num_gpus_per_node:
            raise UserError(Problem("--num_gpus", f"{self.exp_num_gpus} per experiment, but the nodes have "
                                    f"{self.rm.num_gpus_per_node} slots"))
        if self.exp_num_nodes > len(self.rm.nodes):
            raise UserError(Problem("--num_nodes", f"{self.exp_num_nodes} per experiment, but {len(self.rm.nodes)} "
                                    "hosts are available"))
        self.records: dict[str, object] = {}
        self.optimal_cmd: list[str] | None = None
        self.optimal_ds_config: dict | None = None

    def _get_resource_manager(self, active_resources: Mapping[str, Sequence[int]]) -> ResourceManager:
        slots = min((len(s) for s in active_resources.values()), default=0)
        if slots <= 0:
            raise UserError(Problem("active_resources", "no host has a free slot"))
        return ResourceManager(self.args, list(active_resources), slots, self.results_dir, self.exps_dir,
                               self.autotuning_config.arg_mappings)

    def _get_exp_resources(self, args: Namespace) -> tuple[int, int]:
        """Nodes and slots per experiment: the launcher's ``--num_nodes``/``--num_gpus`` when positive, else all."""
        nodes, gpus = getattr(args, "num_nodes", None), getattr(args, "num_gpus", getattr(args, "num_procs", None))
        return (nodes if nodes and nodes > 0 else len(self.rm.nodes),
                gpus if gpus and gpus > 0 else self.rm.num_gpus_per_node)

    def metric(self) -> str:
        return self.autotuning_config.metric

    def fast_enabled(self) -> bool:
        return bool(self.autotuning_config.fast)

    def tune_command(self) -> list[str]:
        """The ``dsrun launch --autotuning tune`` command :meth:`tune` runs: the experiment's size and the script."""
        return [sys.executable, "-m", "dsrun", "launch", "--autotuning", "tune", "--num_nodes",
                str(self.exp_num_nodes), "--num_gpus", str(self.exp_num_gpus), str(self.user_script),
                *self.user_args]

    def tune(self) -> None:
        """Run dsrun's tuner on the script (every experiment a real launch); raises on its failure."""
        code = subprocess.run(self.tune_command(), stdin=subprocess.DEVNULL).returncode
        if code != 0:
            raise RuntimeError(f"autotuning failed (exit code {code}); see {self.results_dir}")
        optimal = Path(self.results_dir) / "ds_config_optimal.json"
        command = Path(self.results_dir) / "cmd_optimal.txt"
        self.optimal_ds_config = json.loads(optimal.read_text()) if optimal.is_file() else None
        self.optimal_cmd = shlex.split(command.read_text()) if command.is_file() else None

    def print_tuning_results(self) -> None:
        summary = Path(self.results_dir) / "summary.txt"
        print(summary.read_text() if summary.is_file() else f"no tuning results in {self.results_dir}")

    def write_optimal_config(self) -> None:
        """dsrun's tuner writes ``ds_config_optimal.json`` and ``cmd_optimal.txt`` itself; this says where."""
        if self.optimal_ds_config is not None:
            print(f"optimal DeepSpeed config: {Path(self.results_dir) / 'ds_config_optimal.json'}")

    def run_after_tuning(self) -> int:
        """Train with the best config found (``cmd_optimal.txt``); its exit code."""
        if not self.optimal_cmd:
            raise RuntimeError(f"no optimal command to run: no experiment completed (see {self.results_dir})")
        return subprocess.run(self.optimal_cmd, stdin=subprocess.DEVNULL).returncode


__all__ = ["Autotuner", "Node", "ResourceManager", "get_val_by_key", "set_val_by_key"]
