from torchvision._stub import missing as _missing

__getattr__ = _missing("torchvision.transforms.v2.functional")
