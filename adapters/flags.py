"""The adapter flags (the environment contract: docs/design.md), read when asked, never frozen at import.

* ``ENABLE_KVCACHED=1`` turns the integration on and implies ``KVCACHED_AUTOPATCH=1``.
* ``KVCACHED_AUTOPATCH=1`` applies the patches when the runtime is imported.
* ``KVCACHED_REQUIRE=1`` makes an unreachable broker or a patch that cannot apply an error at
  startup, instead of a logged warning and an unprotected runtime.
* ``KVCACHED_SGLANG_DSV4_RUNTIME_RESERVATION`` (default on): report DeepSeek-V4 runtime-owned
  pools as reservations.
* ``KVCACHED_SGLANG_DSV4_KV_POOL_BRIDGE`` (default off): bridge a V4 pool into elastic
  management.  Not implemented; turning it on is refused with a clear message.
* ``KVCACHED_BROKER_INSTANCE``: the instance name every TP rank of one server shares
  (validated, with the default when unset, in ``instance``).
"""

from __future__ import annotations

import os
from typing import Mapping

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class FlagError(ValueError):
    """A flag with a value that is neither true nor false.  One line."""


def flag(name: str, default: bool = False, env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    raw = env.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise FlagError(f"{name}={raw!r}: expected 1/0, true/false, yes/no or on/off")


def enabled(env: Mapping[str, str] | None = None) -> bool:
    return flag("ENABLE_KVCACHED", env=env)


def kvcached_switch(env: Mapping[str, str] | None = None) -> bool:
    """``ENABLE_KVCACHED`` as kvcached itself reads it (``true`` or ``1``, any case; anything
    else is off, never an error): whether kvcached's own integration is on."""
    env = os.environ if env is None else env
    return env.get("ENABLE_KVCACHED", "false").lower() in ("true", "1")


def autopatch(env: Mapping[str, str] | None = None) -> bool:
    return enabled(env) or flag("KVCACHED_AUTOPATCH", env=env)


def require(env: Mapping[str, str] | None = None) -> bool:
    return flag("KVCACHED_REQUIRE", env=env)


def required(env: Mapping[str, str] | None = None) -> bool:
    """``KVCACHED_REQUIRE``, where a value that is neither true nor false counts as on (the
    operator asked for something: never run unprotected on a guess)."""
    try:
        return require(env)
    except FlagError:
        return True


def dsv4_runtime_reservation(env: Mapping[str, str] | None = None) -> bool:
    return flag("KVCACHED_SGLANG_DSV4_RUNTIME_RESERVATION", default=True, env=env)


def dsv4_kv_pool_bridge(env: Mapping[str, str] | None = None) -> bool:
    return flag("KVCACHED_SGLANG_DSV4_KV_POOL_BRIDGE", default=False, env=env)


#: every boolean flag the adapters read, with its default
BOOLEAN_FLAGS = {
    "ENABLE_KVCACHED": False,
    "KVCACHED_AUTOPATCH": False,
    "KVCACHED_REQUIRE": False,
    "KVCACHED_SGLANG_DSV4_RUNTIME_RESERVATION": True,
    "KVCACHED_SGLANG_DSV4_KV_POOL_BRIDGE": False,
}


def validate(env: Mapping[str, str] | None = None) -> None:
    """Read every flag once; the first malformed one raises :class:`FlagError` (at startup)."""
    for name, default in BOOLEAN_FLAGS.items():
        flag(name, default, env)
