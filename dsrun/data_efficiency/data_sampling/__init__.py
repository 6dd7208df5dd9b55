"""Curriculum data sampling (DeepSpeed's ``deepspeed.runtime.data_pipeline.data_sampling``): the offline
analyzer that indexes samples by difficulty, the indexed file format, and the sampler and loader that serve
only samples under the current difficulty."""
from dsrun.data_efficiency.data_sampling.data_analyzer import DataAnalyzer
from dsrun.data_efficiency.data_sampling.data_loader import CurriculumDataLoader, truncate_to_difficulty
from dsrun.data_efficiency.data_sampling.data_sampler import DeepSpeedDataSampler
from dsrun.data_efficiency.data_sampling.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder, find_fit_int_dtype

__all__ = ["CurriculumDataLoader", "DataAnalyzer", "DeepSpeedDataSampler", "MMapIndexedDataset",
           "MMapIndexedDatasetBuilder", "find_fit_int_dtype", "truncate_to_difficulty"]
