from torchvision._stub import missing as _missing, unavailable as _unavailable
from torchvision.transforms import InterpolationMode  # noqa: F401

pil_to_tensor = _unavailable("torchvision.transforms.functional.pil_to_tensor")
__getattr__ = _missing("torchvision.transforms.functional")
