"""Helpers for the torchvision stand-in (CPU adapter tests only)."""


def missing(qualname):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"torchvision stub: '{qualname}.{name}' is not available")

    return __getattr__


def unavailable(qualname):
    def _fn(*args, **kwargs):
        raise RuntimeError(f"torchvision stub: '{qualname}' cannot be called")

    _fn.__name__ = qualname.rsplit(".", 1)[-1]
    _fn.__qualname__ = qualname
    return _fn
