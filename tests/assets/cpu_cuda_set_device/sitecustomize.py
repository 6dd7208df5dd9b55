"""Put on PYTHONPATH by the DeepSpeedExamples tests (tests/harness/deepspeed_examples.py), for every process of a
run, dsrun's and DeepSpeed's alike: on a torch built without CUDA, ``torch.cuda.set_device(local_rank)``, which
the examples call unconditionally, raises AttributeError (``torch._C`` has no ``_cuda_setDevice``) under
DeepSpeed as under dsrun; here it does nothing, as choosing a CUDA device means nothing on such a build."""
import torch

if not hasattr(torch._C, "_cuda_setDevice"):
    torch.cuda.set_device = lambda device: None
