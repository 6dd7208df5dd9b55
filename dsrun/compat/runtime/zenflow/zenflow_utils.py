"""``deepspeed.runtime.zenflow.zenflow_utils``: ``_split_affinity``, the split of a rank's cores between training
and ZenFlow's optimizer thread (home: :mod:`dsrun.offload.cores`)."""
from dsrun.offload.cores import _split_affinity

__all__ = ["_split_affinity"]
