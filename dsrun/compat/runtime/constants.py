"""``deepspeed.runtime.constants``: the config keys and defaults client code and tests import (home:
:mod:`dsrun.config.deepspeed_config`, beside the getters that read them)."""
from dsrun.config.deepspeed_config import GRADIENT_CLIPPING, GRADIENT_CLIPPING_DEFAULT, LOG_LEVEL, LOG_LEVEL_DEFAULT

__all__ = ["GRADIENT_CLIPPING", "GRADIENT_CLIPPING_DEFAULT", "LOG_LEVEL", "LOG_LEVEL_DEFAULT"]
