"""kvcached-broker daemon: one per GPU, owning that GPU's memory budget."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvcached-broker")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"
