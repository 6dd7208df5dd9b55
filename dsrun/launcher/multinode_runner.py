"""``deepspeed.launcher.multinode_runner``: DeepSpeed's runner classes, whose command lines are dsrun's own.

Each class keeps DeepSpeed's constructor, attributes and methods (``name``, ``backend_exists()``,
``add_export(key, var)``, ``parse_user_args()``, ``validate_args()``, ``get_cmd(environment,
active_resources)``) and asks dsrun's launch plan (:func:`~dsrun.launcher.plan.plan_for_hosts`) for the
command: ``get_cmd`` returns exactly the argv ``dsrun launch --launcher NAME`` runs for those hosts (the forms
are listed in :mod:`dsrun.launcher.runners` and :mod:`dsrun.launcher.mpi`). ``args`` is the namespace of
``deepspeed.launcher.runner.parse_args``; ``active_resources`` and ``resource_pool`` map each host to its
slot ids or to a slot count. :class:`PDSHRunner` returns ``(cmd, kill_cmd, environment)`` as DeepSpeed's
does: ``environment`` is the one pdsh must start with (``PDSH_RCMD_TYPE=ssh``), ``kill_cmd`` stops this job's
node agents on every host (they take their ranks down).

Differences from DeepSpeed's classes are dsrun's launcher's (docs/launcher.md): the nodes run dsrun's agent
(pdsh, slurm) or dsrun's rank shim (MPI), and the MPI runners accept host filters and ``--num_nodes``.
"""
from __future__ import annotations

import argparse
import re
import shlex
import shutil
from typing import Any, Mapping

from dsrun.launcher.options import LaunchOptions, options_from_args
from dsrun.launcher.plan import LaunchPlan, plan_for_hosts
from dsrun.launcher.protocol import encode_world_info
from dsrun.launcher.runners import RUNNER_TOOLS, pdsh_argv, runner_environment

__all__ = ["MultiNodeRunner", "PDSHRunner", "OpenMPIRunner", "MPICHRunner", "IMPIRunner", "SlurmRunner",
           "MVAPICHRunner", "JSRunner"]


def _slots(resources: Mapping[str, Any] | None) -> dict[str, list[int]] | None:
    """``{host: [slot ids]}`` from slot ids or slot counts."""
    if resources is None:
        return None
    return {host: list(range(v)) if isinstance(v, int) else [int(s) for s in v] for host, v in resources.items()}


class MultiNodeRunner:
    """A multi-node runner: the command that starts a job's ranks on ``active_resources``."""

    runner = ""  # dsrun's runner name (--launcher)

    def __init__(self, args: argparse.Namespace, world_info_base64: str,
                 resource_pool: Mapping[str, Any] | None = None):
        self.args = args
        self.validate_args()
        self.user_arguments = self.parse_user_args()
        # dsrun's namespace names the script `script`; DeepSpeed's (and a test's SimpleNamespace) `user_script`
        self.user_script = getattr(args, "script", None) or getattr(args, "user_script", None)
        self.world_info_base64 = world_info_base64
        self.resource_pool = resource_pool
        self.exports: dict[str, str] = {}  # DeepSpeed's: as a shell line would write them (quoted when needed)
        self._export_values: dict[str, str] = {}  # what the ranks get: the launcher passes them without a shell

    @property
    def name(self) -> str:
        return self.runner

    def backend_exists(self) -> bool:
        """Whether the program this runner starts is on PATH."""
        return shutil.which(RUNNER_TOOLS[self.runner]) is not None

    def add_export(self, key: str, var: str) -> None:
        """Export ``key=var`` to every rank, beyond the variables dsrun's launcher exports itself. ``exports``
        shows a value with characters a shell would read (``64(x2)``) in double quotes, as DeepSpeed's does; the
        ranks get the value itself."""
        key, var = key.strip(), var.strip()
        self._export_values[key] = var
        self.exports[key] = f'"{var}"' if re.search(r"[^\w@%+=:,./-]", var) else var

    def parse_user_args(self) -> list[str]:
        return list(getattr(self.args, "script_args", None) or getattr(self.args, "user_args", None) or [])

    def options(self) -> LaunchOptions:
        options = options_from_args(self.args)
        options.runner = self.runner
        return options

    def validate_args(self) -> None:
        """Raise ValueError naming every inconsistent launcher flag for this runner (a runner class of the
        user's own, with no dsrun runner name, checks nothing here, as DeepSpeed's base class)."""
        if not self.runner:
            return
        problems = self.options().problems()
        if problems:
            raise ValueError("; ".join(str(problem) for problem in problems))

    def plan(self, environment: Mapping[str, str], active_resources: Mapping[str, Any]) -> LaunchPlan:
        """dsrun's launch plan for ``active_resources`` (raises dsrun's UserError on a bad combination)."""
        options = self.options()
        return plan_for_hosts(options, _slots(active_resources), dict(environment), pool=_slots(self.resource_pool),
                              hostfile=options.hostfile, exports=self._export_values)

    def get_cmd(self, environment: Mapping[str, str], active_resources: Mapping[str, Any]) -> list[str]:
        plan = self.plan(environment, active_resources)
        for path, text in plan.files.items():  # mvapich's list of hosts, which the command names
            with open(path, "w") as handle:
                handle.write(text)
        (command,) = plan.commands
        return list(command.argv)


class PDSHRunner(MultiNodeRunner):
    runner = "pdsh"

    def __init__(self, args: argparse.Namespace, world_info_base64: str):
        super().__init__(args, world_info_base64)

    def get_cmd(self, environment: Mapping[str, str],
                active_resources: Mapping[str, Any]) -> tuple[list[str], list[str], dict[str, str]]:
        """``(cmd, kill_cmd, environment)``: pdsh's command, the pdsh command that stops the job's agents,
        and the environment to start pdsh with."""
        cmd = super().get_cmd(environment, active_resources)
        options = self.options()
        hosts = list(_slots(active_resources))
        agent = f"dsrun.launcher.agent --world_info={encode_world_info(_slots(active_resources))}"
        kill_cmd = pdsh_argv(options, hosts, f"pkill -f {shlex.quote(agent)}")
        return cmd, kill_cmd, runner_environment(self.runner, options, dict(environment))


class OpenMPIRunner(MultiNodeRunner):
    runner = "openmpi"


class MPICHRunner(MultiNodeRunner):
    runner = "mpich"


class IMPIRunner(MultiNodeRunner):
    runner = "impi"


class SlurmRunner(MultiNodeRunner):
    runner = "slurm"


class MVAPICHRunner(MultiNodeRunner):
    runner = "mvapich"


class JSRunner(MultiNodeRunner):
    runner = "jsrun"

