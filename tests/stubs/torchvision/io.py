from enum import Enum

from torchvision._stub import missing as _missing, unavailable as _unavailable


class ImageReadMode(Enum):  # transformers 5.8 image_utils imports it at module level
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4
    RGBA = RGB_ALPHA


# sglang <= 0.5.13 (srt/utils/common.py) and transformers 5.8 import these by name.
decode_jpeg = _unavailable("torchvision.io.decode_jpeg")
decode_image = _unavailable("torchvision.io.decode_image")
__getattr__ = _missing("torchvision.io")
