"""dsrun's submitit launchers for Hydra: ``hydra/launcher=submitit_slurm|submitit_local`` under ``dsrun train -m``.

They are hydra-submitit-launcher's own (the ``slurm`` extra installs it), with what a dsrun job needs on top: the
preemption notice as the signal dsrun's ranks save on, requeueing a job whose ranks stopped on it, and each job's
result handed back to ``dsrun train -m``'s summary table. They live in :mod:`._launcher`, a private name: Hydra's
own scan of ``hydra_plugins`` skips it (and so does not warn where hydra-submitit-launcher is not installed), and
dsrun registers them itself. ``dsrun train`` selects them through ``hydra.launcher._target_``
(dsrun.launcher.slurm_jobs); docs/cluster.md, "Slurm".
"""


def register_with_hydra() -> bool:
    """Register the launchers with Hydra (an editable install's ``hydra_plugins`` is invisible to Hydra's own
    scan, as for the Optuna sweeper); False when hydra-submitit-launcher is not installed."""
    try:
        from ._launcher import DsrunLocalLauncher, DsrunSlurmLauncher
    except ImportError:
        return False
    from hydra.core.plugins import Plugins

    for launcher in (DsrunSlurmLauncher, DsrunLocalLauncher):
        Plugins.instance().register(launcher)
    return True
