"""``serve`` options from the command line, the environment and a TOML file, in that order.

Precedence: CLI, then environment, then the config file, then the defaults.  The file is
``--config FILE``, or ``/etc/kvcached-broker/gpu{device}.toml`` when it exists.  It holds every
serve option under the same names as the flags (``lease = 5``, ``metrics_port = 9400``) and
per-instance limits, applied at startup (and so to an instance whenever it registers)::

    headroom = "6GiB"
    lease = 5
    [limits.dsv4-prod]
    min = "30GiB"
    weight = 2
    priority = 10
    [limits.batch]
    max = "10GiB"

What a worker's hello may ask for its own instance is bounded here too
(``hello_max_floor_share = 0.25``, ``hello_max_weight = 2``, ``hello_max_priority = 0``; no flags).

A bad value, from any source, is a one-line error naming the key and where it came from.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping

from ..client import protocol as proto
from ..client.endpoint import EndpointError, validate_endpoint
from ..client.units import SizeError, parse_headroom, parse_size
from .accounts import Limits
from .quotas import DEFAULT_QUOTAS, SessionQuotas

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

DEFAULT_CONFIG = "/etc/kvcached-broker/gpu{device}.toml"
#: The GPU a broker serves, and what it keeps free of it, unless told otherwise.
DEFAULT_DEVICE = 0
DEFAULT_HEADROOM = "5%"


@dataclass
class ServeConfig:
    """Everything ``serve`` can be told.  Sizes in bytes, times in seconds."""

    endpoint: str
    device_index: int = DEFAULT_DEVICE
    headroom: str = DEFAULT_HEADROOM
    state_dir: Path | None = None
    lease_s: float = DEFAULT_QUOTAS.lease_s
    socket_group: int | None = None
    admin_group: int | None = None
    insecure_tcp: bool = False
    curve_dir: Path | None = None  # server.key_secret + authorized/*.key (client public keys)
    probe_interval_s: float = 0.5
    max_sessions: int = DEFAULT_QUOTAS.max_sessions
    max_sessions_per_pid: int = DEFAULT_QUOTAS.max_sessions_per_pid
    max_sessions_per_uid: int = DEFAULT_QUOTAS.max_sessions_per_uid
    hello_rate_per_s: float = DEFAULT_QUOTAS.hello_rate_per_s
    hello_burst: int = DEFAULT_QUOTAS.hello_burst
    #: Connections to the socket, in all and per peer (uid over ipc, address over tcp); None:
    #: every session's plus some for status and admin clients.  Both are lowered to fit the
    #: open-file limit (broker/connections.py).
    max_connections: int | None = None
    max_connections_per_uid: int | None = None
    #: Requests a round answers before it writes the journal and sends its replies.  Small, so
    #: replies keep flowing while later requests wait (a round that swallowed every request in
    #: flight would leave all clients idle until it ends); still enough to share one write.
    max_batch: int = 16
    limits: dict[str, Limits] = field(default_factory=dict)  # instance -> its limits, applied at start
    #: What a worker's hello may ask for its own instance: a floor of at most this share of the
    #: budget, a weight of at most this (the ``limit`` command and the config file are not bound).
    hello_max_floor_share: float = DEFAULT_QUOTAS.hello_max_floor_share
    hello_max_weight: float = DEFAULT_QUOTAS.hello_max_weight
    hello_max_priority: int = DEFAULT_QUOTAS.hello_max_priority

    def connection_limits(self) -> tuple[int, int]:
        """``(in all, per peer)`` before the open-file limit has its say."""
        total = self.max_connections if self.max_connections is not None else self.max_sessions + 256
        per_peer = (self.max_connections_per_uid if self.max_connections_per_uid is not None
                    else self.max_sessions_per_uid + 64)
        return total, per_peer

    def quotas(self) -> SessionQuotas:
        """The session quotas among these options (each field of :class:`SessionQuotas` is one)."""
        return SessionQuotas(**{f.name: getattr(self, f.name) for f in fields(SessionQuotas)})



class ConfigError(ValueError):
    """A bad serve option.  The message names the key and its source, on one line."""


def _size(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        return parse_size(value)
    raise SizeError(f"expected a size such as 80GiB, got {value!r}")


def _headroom(value: Any) -> str:
    text = str(value) if isinstance(value, (int, str)) and not isinstance(value, bool) else None
    if text is None:
        raise SizeError(f"expected a size (4GiB) or a percentage (5%), got {value!r}")
    parse_headroom(text)
    return text


def _non_negative_int(value: Any) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value


def _priority(value: Any) -> int:
    """An instance's reclaim priority (``limit --priority``, ``[limits.X] priority``), within the protocol's bounds."""
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        value = int(value.strip())
    low, high = proto.MIN_PRIORITY, proto.MAX_PRIORITY
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"expected an integer from {low} to {high}, got {value!r}")
    return value


def _positive_int(value: Any) -> int:
    number = _non_negative_int(value)
    if number == 0 or number > 1 << 24:
        raise ValueError(f"expected an integer from 1 to {1 << 24}, got {value!r}")
    return number


def _port(value: Any) -> int:
    port = _non_negative_int(value)
    if not 0 < port < 65536:
        raise ValueError(f"expected a port between 1 and 65535, got {value!r}")
    return port


def _positive_float(value: Any) -> float:
    try:
        number = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        raise ValueError(f"expected a positive number, got {value!r}") from None
    if not number > 0 or number == float("inf"):
        raise ValueError(f"expected a positive number, got {value!r}")
    return number


def _share(value: Any) -> float:
    """A share from 0 to 1: ``0.25`` or ``"25%"``."""
    text = value.strip() if isinstance(value, str) else value
    try:
        if isinstance(text, str) and text.endswith("%"):
            number = float(text[:-1]) / 100.0
        elif isinstance(text, bool):
            raise ValueError
        else:
            number = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"expected a share from 0 to 1 (0.25) or a percentage (25%), got {value!r}") from None
    if not 0.0 <= number <= 1.0:
        raise ValueError(f"expected a share from 0 to 1 (0.25) or a percentage (25%), got {value!r}")
    return number


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.strip().lower() in ("1", "true", "yes", "on")
    raise ValueError(f"expected true or false, got {value!r}")


def _text(value: Any) -> str:
    if not isinstance(value, (str, int)) or isinstance(value, bool) or str(value) == "":
        raise ValueError(f"expected a non-empty string, got {value!r}")
    return str(value)


def _path(value: Any) -> Path:
    return Path(_text(value))


def _directory(value: Any) -> Path:
    path = _path(value)
    if not path.is_dir():
        raise ValueError(f"{str(path)!r} is not a directory")
    return path


#: Longer than any group name a system accepts (glibc's NSS and systemd's userdb abort on
#: some far longer ones, so the name is checked before it is looked up).
MAX_GROUP_NAME = 256
_GID_LIMIT = (1 << 32) - 1  # (gid_t) -1 means "no group"


def _group(value: Any) -> str:
    """A group name or a numeric gid, checked before anything looks it up."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a group name or gid, got {value!r}")
    if value.isascii() and value.isdigit():
        if len(value) > 10 or int(value) >= _GID_LIMIT:
            raise ValueError(f"gid {value[:20]}{'...' if len(value) > 20 else ''} is out of range")
        return value
    if len(value) > MAX_GROUP_NAME:
        raise ValueError(f"a group name of {len(value)} characters is longer than {MAX_GROUP_NAME}")
    if not value.isprintable() or any(c in value for c in " :/,"):
        raise ValueError(f"{value!r} is not a group name (no spaces, ':', '/', ',' or control characters)")
    return value


def _hostname(value: Any) -> str:
    text = _text(value)
    if len(text) > 253 or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", text):
        raise ValueError(f"expected a host name (letters, digits, '.', '-', '_'; at most 253), got {value!r}")
    return text


def _endpoint(value: Any) -> str:
    return validate_endpoint(_text(value))


#: The log levels ``serve`` takes (``--log-level``, the config file, the environment).
LOG_LEVELS = ("debug", "info", "warning", "error")


def _level(value: Any) -> str:
    text = _text(value).lower()
    if text not in LOG_LEVELS:
        raise ValueError(f"expected {', '.join(LOG_LEVELS[:-1])} or {LOG_LEVELS[-1]}, got {value!r}")
    return text


#: option -> (parser, environment variable, default)
OPTIONS: dict[str, tuple[Callable[[Any], Any], str | None, Any]] = {
    "device": (_non_negative_int, "KVCACHED_BROKER_DEVICE", DEFAULT_DEVICE),
    "simulate": (_size, "KVCACHED_BROKER_SIMULATE", None),
    "simulate_usage_dir": (_path, "KVCACHED_BROKER_SIMULATE_USAGE_DIR", None),
    "endpoint": (_endpoint, None, None),  # the environment's KVCACHED_BROKER is a template, read later
    "headroom": (_headroom, "KVCACHED_BROKER_HEADROOM", DEFAULT_HEADROOM),
    "state_dir": (_path, "KVCACHED_BROKER_STATE_DIR", None),
    "no_state": (_bool, "KVCACHED_BROKER_NO_STATE", False),
    "lease": (_positive_float, "KVCACHED_BROKER_LEASE_S", DEFAULT_QUOTAS.lease_s),
    "metrics_port": (_port, "KVCACHED_BROKER_METRICS_PORT", None),
    "metrics_address": (_text, "KVCACHED_BROKER_METRICS_ADDRESS", "127.0.0.1"),
    "metrics_hostname": (_hostname, "KVCACHED_BROKER_METRICS_HOSTNAME", None),  # None: the machine's
    "socket_group": (_group, "KVCACHED_BROKER_SOCKET_GROUP", None),
    "admin_group": (_group, "KVCACHED_BROKER_ADMIN_GROUP", None),
    "insecure_tcp": (_bool, None, False),
    "curve_dir": (_directory, "KVCACHED_BROKER_CURVE_DIR", None),
    "log_level": (_level, "KVCACHED_BROKER_LOG_LEVEL", "info"),
    "log_json": (_bool, "KVCACHED_BROKER_LOG_JSON", False),
    # No flags: the config file or the environment (defaults derived from the session quotas).
    "max_connections": (_positive_int, "KVCACHED_BROKER_MAX_CONNECTIONS", None),
    "max_connections_per_uid": (_positive_int, "KVCACHED_BROKER_MAX_CONNECTIONS_PER_UID", None),
    "hello_max_floor_share": (_share, "KVCACHED_BROKER_HELLO_MAX_FLOOR_SHARE", DEFAULT_QUOTAS.hello_max_floor_share),
    "hello_max_weight": (_positive_float, "KVCACHED_BROKER_HELLO_MAX_WEIGHT", DEFAULT_QUOTAS.hello_max_weight),
    "hello_max_priority": (_priority, "KVCACHED_BROKER_HELLO_MAX_PRIORITY", DEFAULT_QUOTAS.hello_max_priority),
}
LIMIT_KEYS = {"max": _size, "min": _size, "weight": _positive_float, "priority": _priority}


@dataclass
class ServeOptions:
    values: dict[str, Any]
    sources: dict[str, str]
    limits: dict[str, Limits] = field(default_factory=dict)
    config_path: Path | None = None

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None


def resolve(cli: Mapping[str, Any], env: Mapping[str, str] | None = None, config: Path | None = None) -> ServeOptions:
    """Merge the sources; ``cli`` holds None for every flag the user did not give."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    device = _pick("device", cli, env, {}, None, values, sources)
    path = config if config is not None else Path(DEFAULT_CONFIG.format(device=device))
    if config is not None and not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    file_values, limits = _load_file(path) if path.is_file() else ({}, {})
    if "device" in file_values and cli.get("device") is None and not env.get("KVCACHED_BROKER_DEVICE"):
        values.pop("device")
    for key in OPTIONS:
        if key not in values:
            _pick(key, cli, env, file_values, path, values, sources)
    return ServeOptions(values, sources, limits, path if path.is_file() else None)


def _pick(key: str, cli: Mapping[str, Any], env: Mapping[str, str], file_values: Mapping[str, Any],
          path: Path | None, values: dict[str, Any], sources: dict[str, str]) -> Any:
    parser, env_name, default = OPTIONS[key]
    if cli.get(key) is not None and cli.get(key) is not False:
        value, source = cli[key], "command line"
    elif env_name and env.get(env_name, "") != "":
        value, source = env[env_name], f"environment {env_name}"
    elif key in file_values:
        value, source = file_values[key], f"config {path}"
    else:
        values[key], sources[key] = default, "default"
        return default
    try:
        values[key] = parser(value) if source != "command line" else value
    except (ValueError, SizeError, EndpointError) as exc:
        raise ConfigError(f"{source}: key {key!r}: {exc}") from None
    sources[key] = source
    return values[key]


#: No serve config comes near this; a larger file is refused before it is read.
MAX_CONFIG_BYTES = 1 << 20


def _load_file(path: Path) -> tuple[dict[str, Any], dict[str, Limits]]:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"config {path}: cannot read: {exc.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config {path}: larger than {MAX_CONFIG_BYTES} bytes; not a config file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config {path}: not UTF-8 text (byte {exc.start})") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path}: not valid TOML: {str(exc).splitlines()[0]}") from None
    except RecursionError:
        raise ConfigError(f"config {path}: not valid TOML: arrays or tables nested too deeply") from None
    limits_raw = raw.pop("limits", {})
    unknown = sorted(set(raw) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"config {path}: unknown key {unknown[0]!r} (known: {', '.join(OPTIONS)}, limits)")
    if not isinstance(limits_raw, dict):
        raise ConfigError(f"config {path}: key 'limits' must be a table of instances")
    limits = {}
    for instance, table in limits_raw.items():
        limits[instance] = _limit(path, instance, table)
    return raw, limits


def _limit(path: Path, instance: str, table: Any) -> Limits:
    """An instance's limits from the config file: the whole of them (a key left out is its
    default; ``max = "none"`` or no ``max`` is no cap)."""
    where = f"config {path}: key 'limits.{instance}"
    if not isinstance(table, dict):
        raise ConfigError(f"{where}' must be a table with max, min, weight and/or priority")
    limit = Limits(source="config")
    for key, value in table.items():
        if key not in LIMIT_KEYS:
            raise ConfigError(f"{where}.{key}': unknown key (use max, min, weight, priority)")
        try:
            if key == "max" and isinstance(value, str) and value.strip().lower() == "none":
                limit.max_bytes = None
                continue
            if key == "max":
                limit.max_bytes = _size(value)
            elif key == "min":
                limit.min_bytes = _size(value)
            elif key == "priority":
                limit.priority = _priority(value)
            else:
                limit.weight = _positive_float(value)
        except (ValueError, SizeError) as exc:
            raise ConfigError(f"{where}.{key}': {exc}") from None
    return limit
