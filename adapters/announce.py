"""The adapter's few lines for operators, on stderr, whatever the runtime does to logging.

A runtime configures logging its own way: vLLM gives its ``vllm`` logger a handler and
``propagate=False`` and leaves the root logger bare, SGLang configures logging only after
the patches ran, and ``logging.config.dictConfig`` disables every logger it does not name.
Lines that must be seen therefore do not go through a logger at all: they are formatted as
log records and handed straight to a handler of this module's own, which writes to
whatever ``sys.stderr`` is at that moment.  No logger level, ``disabled`` flag, or
``logging.disable`` call is consulted on the way.

There are three such lines, each at most once per process:

* ``event=adapter_active``: the patches applied, with runtime, version, patches, broker
  endpoint, session and instance;
* ``event=unprotected``: this process runs without the broker, and why;
* ``event=instance_default``: ``KVCACHED_BROKER_INSTANCE`` is unset, and the default used.

Format: ``kvcached-broker: LEVEL event=NAME key=value ...`` on one line.
"""

from __future__ import annotations

import logging
import sys
import threading

_lock = threading.Lock()
_said: set[str] = set()


class _StderrHandler(logging.Handler):
    """Writes to the current ``sys.stderr`` (a runtime may have replaced it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stderr must not stop the worker
            self.handleError(record)


_HANDLER = _StderrHandler()
_HANDLER.setFormatter(logging.Formatter("kvcached-broker: %(levelname)s %(message)s"))


def _value(value: object) -> str:
    text = str(value)
    return repr(text) if (not text or any(c in text for c in " '\"=\n")) else text


def line(event: str, **fields: object) -> str:
    """``event=NAME key=value ...`` (values with spaces or quotes are repr-quoted)."""
    parts = [f"event={event}"] + [f"{key}={_value(value)}" for key, value in fields.items() if value is not None]
    return " ".join(parts).replace("\n", " ")


def say(level: int, event: str, **fields: object) -> None:
    """Write one line now, past any logging configuration."""
    record = logging.LogRecord("kvcached_broker.adapters", level, __file__, 0, line(event, **fields), None, None)
    _HANDLER.handle(record)


def once(key: str, level: int, event: str, **fields: object) -> bool:
    """:func:`say`, the first time ``key`` is seen in this process; True if it was said."""
    with _lock:
        if key in _said:
            return False
        _said.add(key)
    say(level, event, **fields)
    return True


def reset() -> None:
    """Forget what was said (tests)."""
    with _lock:
        _said.clear()
