"""Part: the co-located start of the whole-footprint issue (issue 25), once that work has landed.

Issue 25 starts several servers at the same moment on one device, each taking weights,
activations, CUDA graphs and KV, and checks that none overbooks it.  On a GPU the same start
runs with real allocations standing in for weights, activations and graphs.  That work is not
in the tree yet, so this part looks for the module it is to add, :data:`MODULE`, and its entry
point :data:`ENTRY` (``ENTRY(ctx)``, a part's function: :mod:`.parts`); until both exist the
part is skipped and says why.
"""

from __future__ import annotations

import importlib
import importlib.util

from .parts import PartContext
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
