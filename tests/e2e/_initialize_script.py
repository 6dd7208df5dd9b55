"""A user's script for tests/e2e/test_unimplemented.py: ``dsrun.initialize`` on the config file given as the
first argument; prints the keys it refuses (one rank)."""
import sys

import torch

import dsrun
from dsrun.utils.errors import ConfigError

if __name__ == "__main__":
    try:
        dsrun.initialize(model=torch.nn.Linear(2, 2), config=sys.argv[1])  # the launcher appends --local_rank
    except ConfigError as err:
        paths = sorted(p.path for p in err.problems if "not implemented in this version of dsrun" in p.message)
        print("refused: " + ", ".join(paths), flush=True)
