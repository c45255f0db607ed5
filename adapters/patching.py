"""Patches: small, named, version-gated, idempotent, and loud about what they did.

A :class:`Patch` names the module it changes, the versions of the runtime it supports, and a
function that applies it to the imported module.  Applying a patch twice does nothing the
second time (a marker on the module records it).  Every outcome is logged in one line and
kept in :func:`results`, so ``kvcached-broker`` users can see exactly what was patched where.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Mapping, Sequence

from . import announce, flags, process_state
from .versions import in_range, installed

log = announce.logger("kvcached_broker.adapters")


class PatchError(RuntimeError):
    """A patch that cannot apply while ``KVCACHED_REQUIRE=1`` (or is refused outright)."""


@dataclass(frozen=True)
class Target:
    """A symbol a patch changes, as the static check of a release reads it (``make canary``).

    ``symbol`` is ``name`` (a function or class the module defines or imports) or
    ``Class.method`` (a method the class defines itself: a patch never changes an inherited
    one), in the patch's module.  ``params`` are the leading parameters the wrapper relies on,
    in order (``self`` included).  ``optional``: the patch applies without it."""

    symbol: str
    params: tuple[str, ...] = ()
    optional: bool = False


@dataclass(frozen=True)
class AnyOf:
    """Targets of which the release must have one (a patch that applies to whichever it has)."""

    targets: tuple[Target, ...]


@dataclass(frozen=True)
class Patch:
    name: str
    distribution: str  # "sglang" or "vllm": whose version gates the patch
    module: str  # the module the patch changes, applied right after it is imported
    apply: Callable[[ModuleType], None]
    minimum: str | None = None  # first supported version (inclusive)
    below: str | None = None  # first unsupported version (exclusive)
    required: bool = True  # False: optional; a skip is logged but never an error
    #: what the patch changes in ``module`` (for ``make canary``; empty: nothing it can check)
    targets: tuple[Target | AnyOf, ...] = ()
    #: the module layout the patch is for, whatever the supported range (adapters/support.py gates)
    since: str | None = None
    until: str | None = None


@dataclass(frozen=True)
class PatchResult:
    patch: str
    module: str
    outcome: str  # "applied", "already", "skipped", "failed"
    reason: str = ""


class _Results:
    """What each patch did in this process, in order (hook wiring: a reset leaves it)."""

    KEPT_ACROSS_RESET = True

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.results: list[PatchResult] = []


def results() -> list[PatchResult]:
    """What each patch did in this process so far, in order (a copy)."""
    state = process_state.part(_Results)
    with state.lock:
        return list(state.results)


def layout_patches(patches: Sequence[Patch], version: str) -> list[Patch]:
    """Those of ``patches`` for ``version``'s module layout, whatever the supported range (the canary)."""
    return [p for p in patches if in_range(version, p.since, p.until)]


def patches_for(patches: Sequence[Patch], version: str | None, supported: bool) -> list[Patch]:
    """Those of ``patches`` for ``version``'s module layout; every one of them for a release the
    table does not support (each then skips, saying why, or fails under ``KVCACHED_REQUIRE``)."""
    if version is None or not supported:
        return list(patches)
    return layout_patches(patches, version)


def _marker(patch: Patch) -> str:
    return f"__kvcached_broker_patched_{patch.name}__"


def apply_patch(patch: Patch, module: ModuleType) -> PatchResult:
    """Apply ``patch`` to ``module`` now; raise :class:`PatchError` only under KVCACHED_REQUIRE.

    Whatever the patch function raises (``Exception``) makes the patch ``failed``, never the
    runtime's import: a patch half applied is left as it stands, and the runtime's own code
    where it did not reach."""
    if getattr(module, _marker(patch), False):
        return _record(patch, "already")
    version = installed(patch.distribution)
    if version is None:
        return _record(patch, "skipped", f"{patch.distribution} is not installed")
    if not in_range(version, patch.minimum, patch.below):
        span = f">={patch.minimum or 'any'},<{patch.below or 'any'}"
        return _fail_or_skip(patch, "skipped", f"{patch.distribution} {version} is outside the supported range {span}")
    try:
        patch.apply(module)
    except PatchError as exc:
        return _fail_or_skip(patch, "failed", str(exc))
    except Exception as exc:  # noqa: BLE001 - a release the patch was not written for may raise anything:
        # the runtime's import must go on (KVCACHED_REQUIRE=1 alone makes it an error)
        return _fail_or_skip(patch, "failed", f"{type(exc).__name__}: {exc}")
    setattr(module, _marker(patch), True)
    return _record(patch, "applied", f"{patch.distribution} {version}")


def _fail_or_skip(patch: Patch, outcome: str, reason: str) -> PatchResult:
    result = _record(patch, outcome, reason)
    if patch.required and flags.required():
        raise PatchError(f"kvcached-broker patch {patch.name} on {patch.module} did not apply: {reason} (KVCACHED_REQUIRE=1)")
    return result


def _record(patch: Patch, outcome: str, reason: str = "") -> PatchResult:
    result = PatchResult(patch.name, patch.module, outcome, reason)
    state = process_state.part(_Results)
    with state.lock:
        state.results.append(result)
    level = logging.WARNING if outcome == "failed" else logging.INFO
    log.log(level, "event=patch patch=%s module=%s outcome=%s reason=%r", patch.name, patch.module, outcome, reason)
    return result


#: Set on every function the adapters put in place of a runtime's, so wrapping twice is a no-op.
WRAPPED = "__kvcached_broker_wrapped__"


def wrap_once(original: Callable[..., Any], wrapper: Callable[..., Any]) -> Callable[..., Any]:
    """``wrapper`` in place of ``original`` (with its name and docstring), unless ``original`` is
    already one of ours: then ``original``, so a patch applied twice wraps once."""
    if getattr(original, WRAPPED, False):
        return original
    return mark_wrapper(original, wrapper)


def mark_wrapper(original: Callable[..., Any], wrapper: Callable[..., Any]) -> Callable[..., Any]:
    """``wrapper`` given ``original``'s name and docstring and marked as one of ours, whatever
    ``original`` is: for a caller that must wrap a function carrying our mark that is not ours
    (a wrapper someone else made over one of ours with ``functools.wraps``, which copies the
    mark) and so tells its own wrappers by identity."""
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, WRAPPED, True)
    return wrapper


def class_with(module: ModuleType, class_name: str, methods: Any) -> type:
    """``module.class_name``, which must define every one of ``methods`` itself (not inherit it:
    a patch of an inherited method would change the base class too); else :class:`PatchError`."""
    cls = getattr(module, class_name, None)
    if cls is None:
        raise PatchError(f"{module.__name__} has no {class_name}")
    missing = [name for name in methods if name not in vars(cls)]
    if missing:
        raise PatchError(f"{module.__name__}.{class_name} lacks {', '.join(missing)}")
    return cls


def wrap_methods(module: ModuleType, class_name: str,
                 wrappers: Mapping[str, Callable[[Callable[..., Any]], Callable[..., Any]]]) -> type:
    """Wrap each named method of ``module.class_name`` with its ``wrap(original)``, once."""
    cls = class_with(module, class_name, wrappers)
    for name, wrap in wrappers.items():
        setattr(cls, name, wrap(vars(cls)[name]))
    return cls
