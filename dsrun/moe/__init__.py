"""``deepspeed.moe``: Mixture-of-Experts layers with expert parallelism (see docs/moe.md).

``from dsrun.moe.layer import MoE``; the gate and the token exchange are in :mod:`.sharded_moe` and
:mod:`.gating`, the experts in :mod:`.experts`, the optimizer-group helpers in :mod:`.utils`.
"""

from . import layer  # noqa: E402,F401  (``deepspeed.moe.layer.MoE`` after ``import deepspeed``)
