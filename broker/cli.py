"""``kvcached-broker``: serve, status, limit, evict, demo (a contract: docs/design.md, "CLI").

Exit codes: 0 ok, 1 refused, 2 usage, 3 broker unreachable.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from msgspec import UNSET

from ..client import protocol as proto
from ..client import results
from ..client.admin import AdminClient
from ..client.endpoint import EndpointError, resolve_endpoint
from ..client.errors import BrokerError, BrokerUnavailable
from ..client.units import MAX_SIZE_BYTES, SizeError
from . import __version__
from . import config as serve_config
from .interrupt import stopped_by_interrupt
from .quotas import DEFAULT_QUOTAS

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
MAX_PID = (1 << 31) - 1  # the protocol's largest pid
log = logging.getLogger("kvcached_broker")
T = TypeVar("T")


class UsageError(Exception):
    """Bad arguments found after parsing; exits 2 with one line."""


# --------------------------------------------------------------------- types
def _arg_type(parse: Callable[[str], T], name: str) -> Callable[[str], T]:
    """An argparse type from one of the config parsers, so flags and the file agree on values."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except (ValueError, SizeError, EndpointError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name  # argparse names the type in its error messages
    return convert


_size = _arg_type(serve_config.OPTIONS["simulate"][0], "size")
_headroom = _arg_type(serve_config.OPTIONS["headroom"][0], "headroom")
_non_negative_int = _arg_type(serve_config.OPTIONS["device"][0], "integer")
_port = _arg_type(serve_config.OPTIONS["metrics_port"][0], "port")
_hostname = _arg_type(serve_config.OPTIONS["metrics_hostname"][0], "host name")
_positive_float = _arg_type(serve_config.OPTIONS["lease"][0], "number")
_endpoint = _arg_type(serve_config.OPTIONS["endpoint"][0], "endpoint")
_group = _arg_type(serve_config.OPTIONS["socket_group"][0], "group")
_directory = _arg_type(serve_config.OPTIONS["curve_dir"][0], "directory")
_priority = _arg_type(serve_config.LIMIT_KEYS["priority"], "priority")


def _size_or_none(text: str) -> int | None:
    return None if text.strip().lower() == "none" else _size(text)


def _simulated_size(flag: str, text: str) -> int:
    """A size for ``simulate``, within what the protocol carries; UsageError (one line) if not."""
    try:
        size_bytes: int = serve_config.OPTIONS["simulate"][0](text.strip())
    except (ValueError, SizeError) as exc:
        raise UsageError(f"{flag}: {exc}") from None
    if size_bytes > MAX_SIZE_BYTES:
        raise UsageError(f"{flag}: {text!r} is larger than the largest size the broker takes ({MAX_SIZE_BYTES} bytes)")
    return size_bytes


def _process_usage(texts: Sequence[str]) -> dict[int, int]:
    """``{pid: bytes}`` from ``simulate --process PID=SIZE`` flags (SIZE 0 clears that process).

    Each pid is positive, fits the protocol (< 2**31) and is given once; UsageError otherwise."""
    usage: dict[int, int] = {}
    for text in texts:
        pid_text, sep, size_text = text.partition("=")
        pid_text = pid_text.strip()
        if not sep or not pid_text.isdigit() or not 0 < int(pid_text) <= MAX_PID:
            raise UsageError(f"--process: expected PID=SIZE with a pid from 1 to {MAX_PID}, got {text!r}")
        pid = int(pid_text)
        if pid in usage:
            raise UsageError(f"--process: pid {pid} is given twice")
        usage[pid] = _simulated_size("--process", size_text)
    return usage


# -------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcached-broker",
        description="Per-GPU memory broker for co-located LLM serving instances.",
    )
    parser.add_argument("--version", action="version", version=f"kvcached-broker {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    serve = sub.add_parser(
        "serve",
        help="run the broker for one GPU",
        description="Run the broker for one GPU.  Options come from the command line, then the "
        "environment, then the config file (--config, or /etc/kvcached-broker/gpu{device}.toml).",
    )
    serve.add_argument("--device", type=_non_negative_int, default=None, metavar="N", help=f"NVML index of the GPU (default {serve_config.DEFAULT_DEVICE})")
    serve.add_argument("--simulate", type=_size, metavar="SIZE", help="simulate a GPU of SIZE (e.g. 80GiB) instead of NVML")
    serve.add_argument("--simulate-usage-dir", type=Path, metavar="DIR",
                       help="with --simulate: a device shared by processes, each writing its usage to DIR/PID (testing aid)")
    serve.add_argument("--endpoint", type=_endpoint, metavar="URI", help="ipc:///path.sock or tcp://host:port")
    serve.add_argument("--headroom", type=_headroom, default=None, metavar="SIZE|PCT", help=f"kept free (default {serve_config.DEFAULT_HEADROOM})".replace("%", "%%"))
    serve.add_argument("--state-dir", type=Path, metavar="DIR", help="checkpoint directory (default: per-user state dir)")
    serve.add_argument("--no-state", action="store_true", default=None, help="keep no checkpoint (lost if the broker dies)")
    serve.add_argument("--lease", type=_positive_float, default=None, metavar="SECONDS", help=f"session lease (default {DEFAULT_QUOTAS.lease_s:g})")
    serve.add_argument("--config", type=Path, metavar="FILE", help="TOML file with serve options and [limits.INSTANCE]")
    serve.add_argument("--metrics-port", type=_port, metavar="PORT", help="serve Prometheus /metrics on this port")
    serve.add_argument("--metrics-address", metavar="ADDR", help="address for /metrics (default 127.0.0.1)")
    serve.add_argument("--metrics-hostname", type=_hostname, metavar="NAME",
                       help="the host label of every series (default: this machine's host name)")
    serve.add_argument("--socket-group", type=_group, metavar="GROUP", help="group that may connect to the ipc socket")
    serve.add_argument("--admin-group", type=_group, metavar="GROUP", help="group allowed to run limit/evict")
    serve.add_argument("--insecure-tcp", action="store_true", default=None, help="allow tcp on loopback without CURVE")
    serve.add_argument("--curve-dir", type=_directory, metavar="DIR",
                       help="CURVE for tcp: DIR/server.key_secret and DIR/authorized/*.key (see `keygen`)")
    serve.add_argument("--log-level", default=None, choices=serve_config.LOG_LEVELS, metavar="LEVEL",
                       help="debug, info, warning or error (default info)")
    serve.add_argument("--log-json", action="store_true", default=None, help="log one JSON object per line")

    def endpoint_options(p: argparse.ArgumentParser) -> None:
        group = p.add_mutually_exclusive_group()
        group.add_argument("--device", type=_non_negative_int, default=None, metavar="N", help=f"GPU index (default {serve_config.DEFAULT_DEVICE})")
        group.add_argument("--endpoint", type=_endpoint, metavar="URI", help="broker endpoint")
        p.add_argument("--timeout", type=_positive_float, default=3.0, metavar="SECONDS", help=argparse.SUPPRESS)

    status = sub.add_parser("status", help="show the GPU's budget and who holds what")
    endpoint_options(status)
    status.add_argument("--json", action="store_true", help="print the status document as JSON")
    status.add_argument("--watch", type=_positive_float, metavar="SECONDS", help="redraw every SECONDS")
    status.add_argument("--all", action="store_true", help="every GPU's broker on this host")

    limit = sub.add_parser("limit", help="set an instance's limits (admin)")
    limit.add_argument("instance", metavar="INSTANCE")
    endpoint_options(limit)
    limit.add_argument("--max", type=_size_or_none, default=UNSET, metavar="SIZE|none", help="cap; 'none' clears it")
    limit.add_argument("--min", type=_size, default=UNSET, metavar="SIZE", help="guaranteed floor")
    limit.add_argument("--weight", type=_positive_float, default=UNSET, metavar="W", help=f"share weight (default {proto.DEFAULT_WEIGHT:g})")
    limit.add_argument("--priority", type=_priority, default=UNSET, metavar="P",
                       help=f"reclaim order, {proto.MIN_PRIORITY}..{proto.MAX_PRIORITY} (default {proto.DEFAULT_PRIORITY}): "
                       "the lowest is asked for memory back first")
    limit.add_argument("--revision", type=_non_negative_int, default=None, metavar="R", help="apply only at revision R")

    evict = sub.add_parser("evict", help="free a session's memory and fence it (admin)")
    evict.add_argument("session", metavar="SESSION", help="the session id from status (sessions[].id)")
    endpoint_options(evict)
    evict.add_argument("--kill", action="store_true", help="SIGKILL the session's process first")

    sim = sub.add_parser("simulate", help="inject usage into a simulated GPU (testing aid, admin)")
    endpoint_options(sim)
    # Values are checked in cmd_simulate, so that a bad one is a one-line error (exit 2).
    sim.add_argument("--external", metavar="SIZE", help="memory used by unregistered processes")
    sim.add_argument(
        "--process", action="append", default=[], metavar="PID=SIZE",
        help="what the simulated device reports running process PID using, as NVML would (repeatable; "
        "SIZE 0 clears it; the broker drops it once the process exits)",
    )

    keygen = sub.add_parser("keygen", help="create a CURVE key pair (NAME.key, NAME.key_secret) in DIR")
    keygen.add_argument("directory", type=Path, metavar="DIR")
    keygen.add_argument("name", metavar="NAME", help="'server' for the broker, any name for a client")

    sub.add_parser("replay", help="replay a multi-model KV trace under three policies (replay --help)", add_help=False)

    demo = sub.add_parser("demo", help="a simulated GPU with co-located workers, shown live")
    demo.add_argument("--seconds", type=_positive_float, default=8.0, metavar="SECONDS", help="how long to run (default 8)")
    demo.add_argument("--keep", action="store_true", help=argparse.SUPPRESS)
    return parser


# ------------------------------------------------------------------ commands
def _target_endpoint(args: argparse.Namespace) -> str:
    if args.endpoint:
        given: str = args.endpoint  # parsed by _endpoint
        return given
    device = serve_config.DEFAULT_DEVICE if args.device is None else args.device
    try:
        endpoint = resolve_endpoint(device, uuid=_nvml_uuid(device))
    except EndpointError as exc:
        raise UsageError(str(exc)) from None
    if endpoint is None:
        raise UsageError("KVCACHED_BROKER=off: the broker is disabled in this environment")
    return endpoint


def _nvml_uuid(index: int) -> str | None:
    if "{uuid}" not in os.environ.get("KVCACHED_BROKER", ""):
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
        return uuid.decode() if isinstance(uuid, bytes) else uuid
    except Exception:  # noqa: BLE001 - no NVML, no such device: the CLI names the device by index
        return None


def _all_endpoints() -> list[str]:
    """Every broker endpoint on this host: the sockets that exist for a per-device template
    (``{device}`` and/or ``{uuid}`` in ``KVCACHED_BROKER``), else the runtime dir's ``gpuN.sock``."""
    import glob
    import re as _re

    from ..client.endpoint import ipc_path, runtime_dir

    template = os.environ.get("KVCACHED_BROKER", "").strip()
    if template.lower() == "off":
        raise UsageError("KVCACHED_BROKER=off: the broker is disabled in this environment")
    if template and "{device}" not in template and "{uuid}" not in template:
        return [template]
    if template:
        try:
            pattern = ipc_path(template.format(device="*", uuid="*"))
        except (KeyError, IndexError, ValueError) as exc:
            raise UsageError(f"KVCACHED_BROKER={template[:80]!r} is not an endpoint template: {exc}") from None
        if pattern is None:  # tcp: nothing on disk says which devices have a broker
            return [_target_endpoint(argparse.Namespace(endpoint=None, device=0))]
        return [f"ipc://{path}" for path in sorted(glob.glob(glob.escape(str(pattern)).replace("[*]", "*")),
                                                     key=_natural_key)]
    sockets = []
    for path in runtime_dir().glob("gpu*.sock"):
        match = _re.fullmatch(r"gpu(\d+)\.sock", path.name)
        if match:
            sockets.append((int(match.group(1)), f"ipc://{path}"))
    return [endpoint for _, endpoint in sorted(sockets)]


def _natural_key(text: str) -> list[Any]:
    """``gpu2`` before ``gpu10``."""
    import re as _re

    return [int(part) if part.isdigit() else part for part in _re.split(r"(\d+)", text)]


def _fetch(endpoints: list[str], timeout_s: float, strict: bool) -> list[dict[str, Any]]:
    documents = []
    for endpoint in endpoints:
        try:
            with AdminClient(endpoint, timeout_s=timeout_s) as admin:
                documents.append(admin.status())
        except BrokerUnavailable as exc:
            if strict:
                raise
            documents.append({"endpoint": endpoint, "error": exc.message})
    return documents


def _render(documents: list[dict[str, Any]], as_json: bool, bars: bool, many: bool) -> str:
    from .render import render_bars, render_table

    if as_json:
        return json.dumps(documents if many else documents[0], indent=None if bars else 2)
    frames = []
    for doc in documents:
        if "error" in doc:
            frames.append(f"{doc['endpoint']}: unreachable ({doc['error']})")
        else:
            frames.append(render_bars(doc) if bars else render_table(doc))
    return "\n\n".join(frames)


def cmd_status(args: argparse.Namespace) -> int:
    from .render import CLEAR_HOME

    if args.all and (args.endpoint or args.device is not None):
        raise UsageError("--all shows every GPU; do not combine it with --device or --endpoint")
    endpoints = _all_endpoints() if args.all else [_target_endpoint(args)]
    if args.all and not endpoints:
        raise BrokerUnavailable("no kvcached-broker sockets found on this host")
    if args.watch is None:
        print(_render(_fetch(endpoints, args.timeout, strict=not args.all), args.json, False, args.all))
        return EXIT_OK
    interactive = sys.stdout.isatty() and not args.json
    with stopped_by_interrupt() as stop:
        while not stop.is_set():
            try:
                frame = _render(_fetch(endpoints, args.timeout, strict=not args.all), args.json, True, args.all)
            except BrokerUnavailable as exc:
                if args.json:
                    raise
                frame = f"kvcached-broker: {exc.message}; retrying every {args.watch:g}s"
            stamp = time.strftime("%H:%M:%S")
            if interactive:
                sys.stdout.write(CLEAR_HOME + f"every {args.watch:g}s  {stamp}  (Ctrl-C to stop)\n\n" + frame + "\n")
            else:
                sys.stdout.write(frame + "\n" if args.json else f"--- {stamp}\n{frame}\n")
            sys.stdout.flush()
            stop.wait(args.watch)
    return EXIT_OK


def cmd_limit(args: argparse.Namespace) -> int:
    if args.max is UNSET and args.min is UNSET and args.weight is UNSET and args.priority is UNSET:
        raise UsageError("limit: give at least one of --max, --min, --weight, --priority")
    with AdminClient(_target_endpoint(args), timeout_s=args.timeout) as admin:
        result = admin.limit(args.instance, max_bytes=args.max, min_bytes=args.min, weight=args.weight,
                             priority=args.priority, revision=args.revision)
    print(json.dumps(results.as_map(result)))
    return EXIT_OK


def cmd_evict(args: argparse.Namespace) -> int:
    with AdminClient(_target_endpoint(args), timeout_s=args.timeout) as admin:
        result = admin.evict(args.session, kill=args.kill)
    print(json.dumps(results.as_map(result)))
    return EXIT_OK


def cmd_simulate(args: argparse.Namespace) -> int:
    if args.external is None and not args.process:
        raise UsageError("give --external SIZE and/or --process PID=SIZE")
    external = UNSET if args.external is None else _simulated_size("--external", args.external)
    processes = _process_usage(args.process) if args.process else UNSET
    with AdminClient(_target_endpoint(args), timeout_s=args.timeout) as admin:
        print(json.dumps(results.as_map(admin.simulate(external_bytes=external, process_bytes=processes))))
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    from . import logs
    from .device import DeviceError, NvmlDevice, SimulatedDevice
    from .sdnotify import Notifier
    from .security import resolve_group
    from .server import BrokerServer
    from .state_paths import default_state_dir

    cli = {key: getattr(args, key, None) for key in serve_config.OPTIONS}
    try:
        opts = serve_config.resolve(cli, config=args.config)
    except serve_config.ConfigError as exc:
        raise UsageError(str(exc)) from None
    logs.setup(opts.log_level, opts.log_json)
    if opts.config_path is not None:
        log.info("event=config path=%s", opts.config_path)
    try:
        if opts.simulate_usage_dir is not None and not opts.simulate:
            raise UsageError("--simulate-usage-dir needs --simulate SIZE")
        probe = (SimulatedDevice(opts.device, opts.simulate, opts.simulate_usage_dir) if opts.simulate
                 else NvmlDevice(opts.device))
    except DeviceError as exc:
        print(f"kvcached-broker serve: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    endpoint = opts.endpoint
    if endpoint is None:
        try:
            endpoint = resolve_endpoint(opts.device, uuid=probe.info.uuid)
        except EndpointError as exc:
            raise UsageError(str(exc)) from None
        if endpoint is None:
            raise UsageError("KVCACHED_BROKER=off: refusing to serve; unset it or pass --endpoint")
    config = serve_config.ServeConfig(
        endpoint=endpoint,
        device_index=opts.device,
        headroom=opts.headroom,
        state_dir=None if opts.no_state else (opts.state_dir or default_state_dir()),
        lease_s=opts.lease,
        socket_group=resolve_group(opts.socket_group),
        admin_group=resolve_group(opts.admin_group),
        insecure_tcp=opts.insecure_tcp,
        curve_dir=opts.curve_dir,
        limits=opts.limits,
        max_connections=opts.max_connections,
        max_connections_per_uid=opts.max_connections_per_uid,
        hello_max_floor_share=opts.hello_max_floor_share,
        hello_max_weight=opts.hello_max_weight,
        hello_max_priority=opts.hello_max_priority,
    )
    if opts.metrics_port:
        from .metrics import missing_package

        missing = missing_package()
        if missing:
            print(f"kvcached-broker serve: --metrics-port needs {missing}: pip install 'kvcached-broker[metrics]'",
                  file=sys.stderr)
            return EXIT_REFUSED
    server = BrokerServer(config, probe, notifier=Notifier())
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    server.start()
    if opts.metrics_port:
        from .metrics import GpuLabels, start_metrics_server

        info = probe.info
        gpu = GpuLabels(device=str(info.index), uuid=info.uuid, model_name=info.name,
                        hostname=opts.metrics_hostname or socket.gethostname())
        try:
            metrics = start_metrics_server(opts.metrics_port, opts.metrics_address, server.snapshot, gpu)
            server.metrics_view = metrics.view
        except (OSError, RuntimeError) as exc:
            server.close()
            print(f"kvcached-broker serve: cannot serve metrics on {opts.metrics_address}:{opts.metrics_port}: {exc}",
                  file=sys.stderr)
            return EXIT_REFUSED
    server.serve_forever()
    return EXIT_OK


def cmd_keygen(args: argparse.Namespace) -> int:
    import zmq.auth

    if not args.name.replace("-", "").replace("_", "").isalnum():
        raise UsageError(f"key name {args.name!r} may hold only letters, digits, '-' and '_'")
    args.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(args.directory, args.name)
    os.chmod(secret, 0o600)
    print(json.dumps({"public": public, "secret": secret}))
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from ..tools.demo import run_demo  # a tool, not the daemon: imported only when asked for

    return run_demo(seconds=args.seconds, keep=args.keep)


COMMANDS = {
    "serve": cmd_serve,
    "status": cmd_status,
    "limit": cmd_limit,
    "evict": cmd_evict,
    "simulate": cmd_simulate,
    "demo": cmd_demo,
    "keygen": cmd_keygen,
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["replay"]:
        from ..tools.replay import main as replay_main  # a tool, not the daemon

        return replay_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"kvcached-broker {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokerUnavailable as exc:
        print(f"kvcached-broker: cannot reach the broker: {exc.message}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except BrokerError as exc:
        print(f"kvcached-broker {args.command}: refused [{exc.code}]: {exc.message}", file=sys.stderr)
        return EXIT_REFUSED
    except Exception as exc:  # a one-line error for anything that escaped (bad path, lock held)
        from .checkpoint import CheckpointError
        from .device import DeviceError
        from .security import AlreadyRunning, SecurityError

        if isinstance(exc, (AlreadyRunning, SecurityError, CheckpointError, DeviceError, OSError)):
            print(f"kvcached-broker {args.command}: {exc}", file=sys.stderr)
            return EXIT_REFUSED
        raise


def run() -> None:
    sys.exit(main())


if __name__ == "__main__":
    run()
