"""Apply the runtime patches: on import of sglang/vllm (the import hook) or explicitly.

``apply()`` registers every patch of every supported runtime with the import hook; a patch
whose module is already imported applies at once.  With ``ENABLE_KVCACHED=1`` (or
``KVCACHED_AUTOPATCH=1``) the ``kvcached_broker_autopatch.pth`` file that the package installs
calls :func:`install_from_env` at interpreter start, so ``import sglang`` is enough.  That works
from a regular and from an editable install (``pip install -e``), and
:func:`hook_installed` says whether it ran, so a runtime can warn when it did not.
"""

from __future__ import annotations

import importlib
import logging
from typing import Iterable

from . import flags
from .import_hook import when_imported
from .patching import RESULTS, Patch, PatchResult, apply_patch

log = logging.getLogger("kvcached_broker.adapters")

#: runtime -> the module holding its ``PATCHES`` and ``check_flags()``
RUNTIMES = {
    "sglang": "kvcached_broker.adapters.sglang.patches",
    "vllm": "kvcached_broker.adapters.vllm.patches",
}

_registered: set[str] = set()
_hook_ran = False


def patches_for(runtime: str) -> list[Patch]:
    module = importlib.import_module(RUNTIMES[runtime])
    return list(module.PATCHES)


def apply(runtimes: Iterable[str] | None = None) -> list[PatchResult]:
    """Register (and where possible apply) the patches; returns the results so far."""
    for runtime in runtimes or RUNTIMES:
        module = importlib.import_module(RUNTIMES[runtime])
        module.check_flags()
        for patch in module.PATCHES:
            if patch.name in _registered:
                continue
            _registered.add(patch.name)
            when_imported(patch.module, lambda mod, p=patch: apply_patch(p, mod))
    return list(RESULTS)


def install_from_env() -> bool:
    """What the ``.pth`` file calls at interpreter start.  Cheap when the flags are off."""
    global _hook_ran
    if _hook_ran:  # some interpreters process site-packages .pth files twice
        return flags.autopatch()
    _hook_ran = True
    try:
        if not flags.autopatch():
            return False
        apply()
    except Exception as exc:
        if flags.require():
            raise
        log.error("event=autopatch_failed error=%r detail=running_without_kvcached_broker", str(exc))
        return False
    return True


def hook_installed() -> bool:
    """True if the ``.pth`` startup hook ran in this interpreter."""
    return _hook_ran
