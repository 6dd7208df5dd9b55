"""dsrun's Optuna sweeper for Hydra: ``hydra/sweeper=optuna`` with Optuna 3.5+.

The upstream ``hydra-optuna-sweeper`` (1.2/1.3) requires ``optuna<3``; this plugin takes its place with the
same config shape (see :mod:`.config`) and search-space syntax (see :mod:`.optuna_sweeper`). Hydra finds it
through the ``hydra_plugins`` namespace package, which dsrun's wheel and editable installs both provide.
Documented in docs/sweeps.md.
"""


def register_with_hydra() -> None:
    """Register the sweeper and its configs with Hydra directly.

    Hydra finds plugins by listing the ``hydra_plugins`` folders on the import path. An editable install
    (``pip install -e .``) serves this repository's ``hydra_plugins`` through an import hook that such a
    listing cannot see, so ``dsrun`` calls this before it runs Hydra; under a regular install it is
    harmless (the same names are registered again).
    """
    from hydra.core.plugins import Plugins

    from . import config  # noqa: F401 - registers hydra/sweeper=optuna and hydra/sweeper/sampler=*
    from .optuna_sweeper import OptunaSweeper

    Plugins.instance().register(OptunaSweeper)
