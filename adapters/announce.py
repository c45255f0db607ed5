"""The adapters' lines for operators, on stderr, whatever the runtime does to logging.

A runtime configures logging its own way: vLLM gives its ``vllm`` logger a handler and
``propagate=False`` and leaves the root logger bare (so INFO is dropped and a WARNING reaches
stderr only through ``logging.lastResort``, bare), SGLang calls ``logging.basicConfig(force=True)``
at its ``--log-level`` after the patches ran, and ``logging.config.dictConfig`` disables every
logger it does not name.  So the adapters' lines do not go through a configured logger at all:
they are formatted as log records and handed straight to a handler of this module's own, which
writes to whatever ``sys.stderr`` is at that moment.  No logger level, ``disabled`` flag,
``logging.disable`` call or root handler is consulted on the way, and no line is written twice.

* Every adapter module logs through :func:`logger` (an :class:`AdapterLog`): its INFO, WARNING
  and ERROR lines always reach stderr; DEBUG goes to the standard logger of the same name, as
  the process configured it.
* :func:`once` says a line at most once per process: ``event=adapter_active`` (the patches
  applied, with runtime, version, patches, broker endpoint, session and instance),
  ``event=unprotected`` (this process runs without the broker, and why),
  ``event=instance_default`` (``KVCACHED_BROKER_INSTANCE`` is unset, and the default used).

Format: ``kvcached-broker: LEVEL YYYY-MM-DD HH:MM:SS.mmm event=NAME key=value ...``, one line.
"""

from __future__ import annotations

import logging
import sys
import threading
from types import TracebackType

from . import process_state

#: What ``exc_info=`` may be, as for :meth:`logging.Logger.log`.
ExcInfo = (bool | BaseException | tuple[type[BaseException], BaseException, TracebackType | None]
           | tuple[None, None, None] | None)



class _StderrHandler(logging.Handler):
    """Writes to the current ``sys.stderr`` (a runtime may have replaced it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stderr must not stop the worker
            self.handleError(record)


#: The prefix of every line (and the start of its format: ``kvcached-broker: LEVEL TIME message``).
PREFIX = "kvcached-broker:"
_HANDLER = _StderrHandler()
_HANDLER.setFormatter(logging.Formatter(f"{PREFIX} %(levelname)s %(asctime)s.%(msecs)03d %(message)s",
                                        "%Y-%m-%d %H:%M:%S"))


class AdapterLog:
    """An adapter module's log, with :class:`logging.Logger`'s calls: INFO and above are written
    through this module's handler (past any logging configuration); DEBUG goes to the standard
    logger ``name``, as the process configured it."""

    def __init__(self, name: str):
        self.name = name
        self._logger = logging.getLogger(name)

    def isEnabledFor(self, level: int) -> bool:  # logging.Logger's name
        return level >= logging.INFO or self._logger.isEnabledFor(level)

    def log(self, level: int, msg: object, *args: object, exc_info: ExcInfo = None, stacklevel: int = 1) -> None:
        if level < logging.INFO:
            self._logger.log(level, msg, *args, exc_info=exc_info, stacklevel=stacklevel + 1)
            return
        if exc_info is True or isinstance(exc_info, BaseException):
            exc_info = sys.exc_info() if exc_info is True else (type(exc_info), exc_info, exc_info.__traceback__)
        frame = sys._getframe(stacklevel)
        record = self._logger.makeRecord(self.name, level, frame.f_code.co_filename, frame.f_lineno, msg, args,
                                         exc_info or None, frame.f_code.co_name)
        _HANDLER.handle(record)

    def debug(self, msg: object, *args: object, exc_info: ExcInfo = None) -> None:
        self.log(logging.DEBUG, msg, *args, exc_info=exc_info, stacklevel=2)

    def info(self, msg: object, *args: object, exc_info: ExcInfo = None) -> None:
        self.log(logging.INFO, msg, *args, exc_info=exc_info, stacklevel=2)

    def warning(self, msg: object, *args: object, exc_info: ExcInfo = None) -> None:
        self.log(logging.WARNING, msg, *args, exc_info=exc_info, stacklevel=2)

    def error(self, msg: object, *args: object, exc_info: ExcInfo = None) -> None:
        self.log(logging.ERROR, msg, *args, exc_info=exc_info, stacklevel=2)

    def exception(self, msg: object, *args: object, exc_info: ExcInfo = True) -> None:
        self.log(logging.ERROR, msg, *args, exc_info=exc_info, stacklevel=2)


def logger(name: str) -> AdapterLog:
    """The log of adapter module ``name`` (``kvcached_broker.adapters...``)."""
    return AdapterLog(name)


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
    said = process_state.part(_Said)
    with said.lock:
        if key in said.keys:
            return False
        said.keys.add(key)
    say(level, event, **fields)
    return True


class _Said:
    """The keys :func:`once` has said in this process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.keys: set[str] = set()


def handler() -> logging.Handler:
    """The handler every adapter line at INFO and above goes through, whatever the process's logging
    configuration (a filter added to it sees each record as it is written)."""
    return _HANDLER


def reset() -> None:
    """Forget what was said (tests)."""
    process_state.forget(_Said)
