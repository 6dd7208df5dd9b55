"""``deepspeed.runtime.sequence_parallel.ulysses_sp`` (ALST): its tiled compute (home:
:mod:`dsrun.sequence.tiled_compute`) and its Ulysses for Hugging Face models (home: :mod:`dsrun.sequence.ulysses_hf`)."""
from dsrun.sequence.tiled_compute import SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute
from dsrun.sequence.ulysses_hf import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

__all__ = ["SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledMLP", "UlyssesSPAttentionHF",
           "UlyssesSPDataLoaderAdapter", "sequence_tiled_compute"]
