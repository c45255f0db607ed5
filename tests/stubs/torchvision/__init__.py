"""Import-only stand-in for torchvision, for CPU tests of SGLang adapters.

PyPI torchvision wheels link CUDA torch and do not load with CPU torch.
sglang.srt (and transformers, once it finds a `torchvision` spec) import a few
names at module level; nothing on the KV-pool / allocator paths calls them.
Other attributes raise AttributeError; the stub callables raise RuntimeError.
Keep this off PYTHONPATH for vLLM (it needs no torchvision at all).
"""
from torchvision._stub import missing as _missing

__version__ = "0.0.0+stub"
__getattr__ = _missing("torchvision")
