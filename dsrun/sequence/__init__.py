"""``dsrun.sequence``: DeepSpeed-Ulysses sequence parallelism (``dsrun.sequence.layer.DistributedAttention``)."""
from .layer import DistributedAttention, single_all_to_all

__all__ = ["DistributedAttention", "single_all_to_all"]
