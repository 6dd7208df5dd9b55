"""``dsrun.sequence``: DeepSpeed-Ulysses sequence parallelism (``dsrun.sequence.layer.DistributedAttention``)."""
from .batch import shard_sequence
from .layer import DistributedAttention, single_all_to_all

__all__ = ["DistributedAttention", "shard_sequence", "single_all_to_all"]
