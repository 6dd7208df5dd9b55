"""dsrun's Optuna sweeper for Hydra: ``hydra/sweeper=optuna`` with Optuna 3.5+.

The upstream ``hydra-optuna-sweeper`` (1.2/1.3) requires ``optuna<3``; this plugin takes its place with the
same config shape (see :mod:`.config`) and search-space syntax (see :mod:`.optuna_sweeper`). Hydra finds it
through the ``hydra_plugins`` namespace package, which dsrun's wheel and editable installs both provide.
Documented in docs/sweeps.md.
"""
