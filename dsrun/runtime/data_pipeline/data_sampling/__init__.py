"""Curriculum data sampling (DeepSpeed's ``deepspeed.runtime.data_pipeline.data_sampling``): the offline
analyzer that indexes samples by difficulty, the indexed file format, and the sampler and loader that serve
only samples under the current difficulty."""
from .data_analyzer import DataAnalyzer
from .data_loader import CurriculumDataLoader, truncate_to_difficulty
from .data_sampler import DeepSpeedDataSampler
from .indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder, find_fit_int_dtype

__all__ = ["CurriculumDataLoader", "DataAnalyzer", "DeepSpeedDataSampler", "MMapIndexedDataset",
           "MMapIndexedDatasetBuilder", "find_fit_int_dtype", "truncate_to_difficulty"]
