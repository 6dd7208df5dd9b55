"""EXAONE 4.0 and 4.5 (served as DeepSpeed's ``model_implementations.exaone4`` and ``exaone4_5``)."""
from .model import Exaone4_5InferenceModel, Exaone4InferenceModel

__all__ = ["Exaone4InferenceModel", "Exaone4_5InferenceModel"]
