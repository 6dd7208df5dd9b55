"""Ops compiled at install time (DSRUN_BUILD_OPS=1 pip install .) land here; empty otherwise."""
