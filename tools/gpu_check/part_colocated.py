"""Part: the co-located start of the whole-footprint issue (issue 25).

Several servers start at the same moment on one device, each taking weights, activations,
CUDA graphs and KV, and none may overbook it (:mod:`kvcached_broker.tools.colocation`, whose
entry point :data:`ENTRY` is this part's function).  Found by name, so that a tree without that
module says so and skips rather than failing to import.
"""

from __future__ import annotations

import importlib
import importlib.util

from .context import PartContext
from .record import Skip

MODULE = "kvcached_broker.tools.colocation"
ENTRY = "gpu_check"


def run(ctx: PartContext) -> None:
    if importlib.util.find_spec(MODULE) is None:
        raise Skip(f"not landed yet: issue 25's co-located start (no module {MODULE})")
    entry = getattr(importlib.import_module(MODULE), ENTRY, None)
    if entry is None:
        raise Skip(f"not landed yet: {MODULE} has no {ENTRY}(ctx)")
    entry(ctx)
