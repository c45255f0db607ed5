"""Apply the runtime patches: on import of sglang/vllm (the import hook) or explicitly.

``apply()`` registers every patch of every supported runtime with the import hook; a patch
whose module is already imported applies at once.  With ``ENABLE_KVCACHED=1`` (or
``KVCACHED_AUTOPATCH=1``) the ``kvcached_broker_autopatch.pth`` file that the package installs
calls :func:`install_from_env` at interpreter start, so ``import sglang`` is enough.  That works
from a regular and from an editable install (``pip install -e``), and
:func:`hook_installed` says whether it ran, so a runtime can warn when it did not.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import threading
from types import ModuleType
from typing import Iterable

from . import announce, flags, instance, process_state, release_check, startup_hook
from .import_hook import when_imported
from .patching import PatchError, PatchResult, apply_patch, results

log = announce.logger("kvcached_broker.adapters")

#: runtime -> the module holding its ``PATCHES`` and ``check_flags()``
RUNTIMES = {
    "sglang": "kvcached_broker.adapters.sglang.patches",
    "vllm": "kvcached_broker.adapters.vllm.patches",
    "kvcached": "kvcached_broker.adapters.kvcached.patches",
}

class _Hook:
    """The patches registered with the import hook (hook wiring: a reset leaves it)."""

    KEPT_ACROSS_RESET = True

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.registered: set[str] = set()


def apply(runtimes: Iterable[str] | None = None) -> list[PatchResult]:
    """Register (and where possible apply) the patches; returns the results so far.

    An installed release outside the supported range registers none of its runtime's patches
    (:mod:`.release_check`): under ``KVCACHED_REQUIRE=1`` that is :class:`~.release_check.UnsupportedRelease`,
    else one ``event=unprotected`` line, now or, beside a supported release of the other serving
    runtime, when it is imported."""
    for runtime in runtimes or RUNTIMES:
        found = release_check.finding(runtime)
        if found is not None:
            if release_check.at_import(found):
                when_imported(runtime, functools.partial(_unsupported_at_import, found))
            else:
                _unsupported(found)
            continue
        module = importlib.import_module(RUNTIMES[runtime])
        module.check_flags()
        hook = process_state.part(_Hook)
        for patch in module.PATCHES:
            with hook.lock:
                if patch.name in hook.registered:
                    continue
                hook.registered.add(patch.name)
            when_imported(patch.module, functools.partial(apply_patch, patch))
    return results()


def _unsupported_at_import(found: release_check.Finding, _module: ModuleType) -> None:
    _unsupported(found, at_import=True)


def _unsupported(found: release_check.Finding, at_import: bool = False) -> None:
    """An unsupported release: under KVCACHED_REQUIRE=1 the start stops (from inside the runtime's
    import: exit at once, as at interpreter start); else this process says it runs unprotected."""
    if flags.required():
        failure = release_check.UnsupportedRelease(f"{found.reason()} (KVCACHED_REQUIRE=1)")
        if at_import:
            startup_failed(failure)
        raise failure
    announce.once("unprotected", logging.WARNING, "unprotected", pid=os.getpid(), runtime=found.runtime.name,
                  version=found.version, supported=str(found.runtime.supported), reason=found.reason(),
                  detail="its patches are not applied: this process's GPU memory is not arbitrated by kvcached-broker")


def install_from_env() -> bool:
    """What the ``.pth`` file calls at interpreter start.  Cheap when the flags are off.

    A ``.pth`` line cannot stop a start by raising: ``site`` prints the traceback and goes
    on.  So a failure here (a malformed flag, a refused flag, an import error, a patch that
    cannot apply) is written as one line on stderr, and then either the interpreter runs on
    without the broker (one ``event=autopatch_failed`` warning) or, with
    ``KVCACHED_REQUIRE=1``, it exits at once with :data:`REQUIRE_EXIT_CODE`, before any
    runtime module is imported.
    """
    if startup_hook.mark_ran():  # some interpreters process site-packages .pth files twice
        return _autopatch_quietly()
    try:
        if not flags.autopatch():
            return False
        flags.validate()
        instance.explicit()
        apply()
    except Exception as exc:  # noqa: BLE001 - nothing may escape into site
        return startup_failed(exc)
    return True


#: The exit status of an interpreter that ``KVCACHED_REQUIRE=1`` stopped at start (EX_CONFIG).
REQUIRE_EXIT_CODE = 78


def startup_failed(exc: BaseException) -> bool:
    """Say why the hook failed, in one line; exit under ``KVCACHED_REQUIRE=1``, else go on."""
    reason = str(exc) if isinstance(exc, (PatchError, flags.FlagError)) else f"{type(exc).__name__}: {exc}"
    if flags.required():
        announce.say(logging.ERROR, "startup_refused", reason=reason, detail="KVCACHED_REQUIRE=1 stops this start")
        os._exit(REQUIRE_EXIT_CODE)
    announce.say(logging.WARNING, "autopatch_failed", reason=reason, detail="running without kvcached-broker")
    return False


def _autopatch_quietly() -> bool:
    try:
        return flags.autopatch()
    except flags.FlagError:
        return False


def hook_installed() -> bool:
    """True if the ``.pth`` startup hook ran in this interpreter (:mod:`.startup_hook`)."""
    return startup_hook.installed()
