"""Small helpers shared by every layer: user-facing errors, suggestions, package paths, a free TCP port, and
DeepSpeed's ``RepeatingLoader`` (``dsrun.utils.RepeatingLoader``)."""
from .repeating_loader import RepeatingLoader

__all__ = ["RepeatingLoader"]
