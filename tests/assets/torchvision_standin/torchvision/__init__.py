"""A stand-in for the torchvision names DeepSpeedExamples' pipeline example uses (see ../README.md): models
(AlexNet, vgg19), transforms (Compose, Resize, CenterCrop, ToTensor, Normalize) and CIFAR10 over the pickled
batch folder. Only for the tests and benchmarks, where the real torchvision cannot be imported."""
from torchvision import datasets, models, transforms

__version__ = "0.0.0+standin"
__all__ = ["datasets", "models", "transforms"]
