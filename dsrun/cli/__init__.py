"""The ``dsrun`` command line: one module per subcommand, dispatched by :mod:`dsrun.cli.__main__`."""
