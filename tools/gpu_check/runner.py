"""Run the GPU check's parts, each in a process of its own with its own time limit; write the outputs.

    python -m kvcached_broker.tools.gpu_check.runner --mode gpu|simulate --out DIR [--only P,Q]
        [--budget-s 480] [--kvcached-sdist FILE] [--compare FILE | --compare-dir DIR] [--install JSON]

``scripts/gpu-check`` is the way in (it installs what a GPU machine lacks first); this module is
what it runs once the package imports.  Each part (:mod:`.parts`) gets a fresh process in a
session of its own and a limit: its own, or less so that the run ends within ``--budget-s``.  A
part that fails, raises, crashes or runs out of time is recorded as such, with what it measured
until then, and the next part runs.  On a GPU, kvcached's sdist is built in the background while
the first parts run, and the part that needs it waits for the build.

Writes ``DIR/gpu-check.json`` and ``DIR/gpu-check.txt`` (:mod:`.report`), prints the summary,
and exits 0 when every part that ran passed, 1 otherwise.

    python -m kvcached_broker.tools.gpu_check.runner --part NAME --mode M --workdir W --result FILE --deadline T

runs one part in this process (what the runner starts for each part).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from .context import PartContext
from .devices import Device
from .kvcached_build import KvcachedBuild
from .parts import Part, by_name
from .record import PartRecord, Skip, read_record
from .report import SCHEMA, compare, differences, load_reference, newest_reference, render

MODULE = "kvcached_broker.tools.gpu_check.runner"
BUDGET_S = 480.0  # 8 minutes on the GPU, install included
FINISH_RESERVE_S = 8.0  # kept at the end for writing the outputs
MIN_PART_S = 10.0  # a part is not started with less than this
KILL_GRACE_S = 3.0
LOG_CAP_BYTES = 1 << 20  # each log's last MiB goes into gpu-check-logs.tar.gz
LOG_SUFFIXES = (".log", ".err", ".json")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu-check runner", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("gpu", "simulate"), required=True)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", help="comma-separated part names (default: every part)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S)
    parser.add_argument("--kvcached-sdist", type=Path)
    parser.add_argument("--compare", type=Path, help="a GPU run's JSON to compare a simulated run with")
    parser.add_argument("--compare-dir", type=Path, help="where GPU runs are kept (the newest is compared)")
    parser.add_argument("--install", help="what the launcher installed, as JSON (shown in the outputs)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs of every process)")
    # one part, in this process
    parser.add_argument("--part")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--result", type=Path)
    parser.add_argument("--deadline", type=float, help="time.monotonic() by which the part must end")
    parser.add_argument("--kvcached-path", type=Path)
    args = parser.parse_args(argv)
    if args.part is None and args.out is None:
        parser.error("--out is required")
    if args.part is not None and None in (args.workdir, args.result, args.deadline):
        parser.error("--part needs --workdir, --result and --deadline")
    if args.budget_s <= 0:
        parser.error("--budget-s must be positive")
    return args


# ----------------------------------------------------------------------------- one part
def part_main(args: argparse.Namespace) -> int:
    """Run one part here and leave its record (with ``status`` and ``why``) in ``--result``."""
    (part,) = by_name([args.part])
    record = PartRecord(args.result, part.name, args.mode)
    args.workdir.mkdir(parents=True, exist_ok=True)
    ctx = PartContext(Device(args.mode, args.workdir), record, args.workdir, args.deadline, args.kvcached_path)
    status, why = "ok", ""
    try:
        part.run(ctx)
    except Skip as exc:
        status, why = "skipped", str(exc)
    except Exception as exc:  # noqa: BLE001 - a part's failure is its record's, not the run's
        status, why = "error", f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        record.data["trace"] = traceback.format_exc()[-4000:]
    record.finish(status, why)
    return 0


# ----------------------------------------------------------------------------- the run
class Run:
    """One run of the check: the parts in order, under one budget."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.started = time.monotonic()
        self.deadline = self.started + args.budget_s
        self.workdir = Path(tempfile.mkdtemp(prefix="kvbgc-", dir="/tmp"))  # short: ipc paths live here
        self.build: KvcachedBuild | None = None
        self.install: dict[str, Any] = json.loads(args.install) if args.install else {}

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def execute(self, parts: list[Part]) -> dict[str, Any]:
        when = time.strftime("%Y-%m-%d %H:%M:%S %z")
        if self.args.mode == "gpu" and any(p.needs_kvcached for p in parts) and self.args.kvcached_sdist:
            self.build = KvcachedBuild(self.args.kvcached_sdist, self.workdir / "kvcached-site", self.workdir).start()
        about = machine(self.args.mode)  # before the parts: importing torch takes seconds of the budget
        results = {}
        try:
            for part in parts:
                results[part.name] = self.run_part(part)
                print(f"gpu-check: {part.name}: {results[part.name]['status']} "
                      f"({results[part.name]['wall_s']:.1f} s)", flush=True)
        finally:
            if self.build is not None:
                self.build.stop()
        doc = {"schema": SCHEMA, "mode": self.args.mode, "started": when, "budget_s": self.args.budget_s,
               "machine": about, "install": self.install, "parts": results,
               "derived": derived(results),
               "differences": differences(results) if self.args.mode == "gpu" else [], "comparison": None}
        doc["ok"] = all(p["status"] in ("ok", "skipped") for p in results.values())
        doc["wall_s"] = time.monotonic() - self.started
        return doc

    def run_part(self, part: Part) -> dict[str, Any]:
        started = time.monotonic()
        base = {"title": part.title, "limit_s": 0.0, "figures": {}, "assumed": {}, "checks": [], "notes": []}
        kvcached_path = None
        if part.needs_kvcached and self.args.mode == "gpu":
            kvcached_path, why = self.kvcached_ready()
            if kvcached_path is None:  # on a GPU machine the build must work: not a skip
                return {**base, "status": "error", "why": why, "wall_s": time.monotonic() - started,
                        "log_tail": self.install.get("kvcached_build_log_tail", "")}
        limit = min(part.limit_s, self.left_s() - FINISH_RESERVE_S)
        if limit < MIN_PART_S:
            return {**base, "status": "skipped", "why": f"out of time: {self.left_s():.0f} s of the budget left",
                    "wall_s": 0.0}
        workdir = self.workdir / part.name
        workdir.mkdir()
        result = workdir / "record.json"
        log = workdir / "part.log"
        command = [sys.executable, "-m", MODULE, "--part", part.name, "--mode", self.args.mode,
                   "--workdir", str(workdir), "--result", str(result), "--deadline", str(time.monotonic() + limit - 1.0)]
        if kvcached_path is not None:
            command += ["--kvcached-path", str(kvcached_path)]
        timed_out = run_limited(command, log, limit)
        record = read_record(result) or {}
        out = {**base, **{k: v for k, v in record.items() if k in base or k in ("status", "why", "trace")}}
        out["limit_s"] = limit
        out["wall_s"] = time.monotonic() - started
        if timed_out:
            out.update(status="timeout", why=f"stopped at its time limit ({limit:.0f} s); the figures are those "
                                               f"measured until then")
        elif "status" not in out:
            out.update(status="error", why="the part's process ended without a result")
        if self.args.mode == "simulate":
            add_assumption_checks(out)
        if out["status"] in ("error", "timeout", "failed"):
            out["log_tail"] = tail(log, 3000)
        return out

    def kvcached_ready(self) -> tuple[Path | None, str]:
        if self.build is None:
            return None, "kvcached's sdist is not among the carried files (scripts/gpu-check --prepare)"
        wait = self.left_s() - FINISH_RESERVE_S - MIN_PART_S * 3
        result = self.build.wait(wait)
        self.install["kvcached_build"] = ("ok" if result.ok else "failed: " + result.why) + f" ({result.seconds:.0f} s)"
        if not result.ok:
            self.install["kvcached_build_log_tail"] = result.log_tail[-1500:]
            return None, f"kvcached could not be built: {result.why}"
        return self.build.target, ""

    def archive_logs(self, out: Path) -> Path:
        """Every process's log (its last MiB), as ``out/gpu-check-logs.tar.gz``: what a failed run
        on a machine that is gone again can be read from."""
        path = out / "gpu-check-logs.tar.gz"
        out.mkdir(parents=True, exist_ok=True)
        with tarfile.open(path, "w:gz") as tar:
            for file in sorted(self.workdir.rglob("*")):
                if file.suffix not in LOG_SUFFIXES or not file.is_file() or file.is_symlink() \
                        or "kvcached-site" in file.parts:
                    continue
                data = file.read_bytes()[-LOG_CAP_BYTES:]
                info = tarfile.TarInfo(file.relative_to(self.workdir).as_posix())
                info.size, info.mtime = len(data), int(file.stat().st_mtime)
                tar.addfile(info, io.BytesIO(data))
        return path

    def close(self) -> None:
        if self.args.keep:
            print(f"gpu-check: work folder kept: {self.workdir}")
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)


def add_assumption_checks(part: dict[str, Any]) -> None:
    """On the simulated device every figure with an assumption must equal it (see :mod:`.record`)."""
    if part["status"] in ("skipped", "timeout", "error"):
        return
    figures = part.get("figures", {})
    for key, assumed in part.get("assumed", {}).items():
        measured = figures.get(key)
        part["checks"].append({"name": f"the simulated device gives {key} as the check assumes",
                               "ok": measured == assumed, "detail": f"measured {measured!r}, assumed {assumed!r}"})
    if part["status"] == "ok" and not all(c["ok"] for c in part["checks"]):
        part["status"] = "failed"


def derived(parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Figures of two parts together: the hand-over against its physical floor, the pages it moved
    unmapped by A and mapped by B at the driver's cost per page (empty unless both parts ran)."""
    pages = parts.get("vmm_pages", {}).get("figures", {})
    pools = parts.get("kvcached_pools", {}).get("figures", {})
    moved, page = pools.get("a_unmapped_bytes_p50"), pages.get("page_bytes")
    per_page = [pages.get("map_page_p50_s"), pages.get("unmap_page_p50_s")]
    if not moved or not page or any(v is None for v in per_page):
        return {}
    floor = moved // page * sum(per_page)
    handover = pools.get("handover_p50_s")
    return {"handover_pages_moved": moved // page, "handover_floor_s": floor,
            "handover_over_floor": handover / floor if handover is not None and floor else None}


def run_limited(command: list[str], log: Path, limit_s: float) -> bool:
    """Run ``command`` in a session of its own (its children too) for at most ``limit_s``;
    True if it had to be stopped."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(limit_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    finally:
        # Whatever the part left behind in its session (a broker, workers, after a crash) goes too.
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
    return timed_out


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def tail(path: Path, chars: int) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def machine(mode: str) -> dict[str, Any]:
    """What ran the check.  Never initialises CUDA here: a context in the runner would be a process
    the parts' brokers count as external."""
    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "cpus": os.cpu_count()}
    if mode == "simulate":
        info["device"] = "simulated device"
        return info
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        info["device"] = name.decode() if isinstance(name, bytes) else name
        driver = pynvml.nvmlSystemGetDriverVersion()
        info["driver"] = driver.decode() if isinstance(driver, bytes) else driver
        info["total_bytes"] = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
    except Exception as exc:  # noqa: BLE001 - the run says what it could not read
        info["device"] = f"unknown ({type(exc).__name__}: {exc})"
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
    except Exception as exc:  # noqa: BLE001 - the run says what it could not read
        info["torch"] = f"not importable ({type(exc).__name__})"
    return info


def write_outputs(doc: dict[str, Any], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, text_path = out / "gpu-check.json", out / "gpu-check.txt"
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    text_path.write_text(render(doc))
    return json_path, text_path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.part is not None:
        return part_main(args)
    try:
        parts = by_name(args.only.split(",") if args.only else None)
        reference_path = args.compare or (newest_reference(args.compare_dir) if args.compare_dir else None)
        reference = load_reference(reference_path) if reference_path and args.mode == "simulate" else None
    except ValueError as exc:
        print(f"gpu-check: {exc}", file=sys.stderr)
        return 2
    run = Run(args)
    try:
        doc = run.execute(parts)
        if reference is not None:
            doc["comparison"] = {"reference": str(reference_path), "rows": compare(doc["parts"], reference)}
        json_path, text_path = write_outputs(doc, args.out)
        logs = run.archive_logs(args.out)
    finally:
        run.close()
    sys.stdout.write(render(doc))
    print(f"gpu-check: wrote {json_path}, {text_path} and {logs}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
