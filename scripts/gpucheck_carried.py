"""The files the GPU check carries to a GPU machine that cannot download anything (standard library only).

``scripts/gpu-check --prepare`` gathers them here, into ``.gpu-check/`` (ignored by git):

* ``wheels/``: pyzmq, msgspec and posix_ipc (kvcached's segment code) for CPython 3.12 on
  manylinux x86_64, pinned (``WHEEL_PINS``), and the project's own wheel (``pip wheel .``);
* ``sdist/kvcached-0.1.6.tar.gz``: built on the GPU machine with its CUDA extension,
  sha256-checked against the pin in scripts/fetch-kvcached.py;
* ``manifest.json``: every file with its size and sha256, the Python it is for, and a digest of
  the project's sources when its wheel was built.

On the GPU machine ``scripts/gpu-check`` verifies the manifest (a missing or altered file is a
one-line error that installs nothing), installs the wheels into a fresh folder, and rebuilds
the project's wheel from the tree if the tree has changed since (the machine has setuptools).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CARRIED = ".gpu-check"
MANIFEST = "manifest.json"
PYTHON_VERSION = "3.12"
#: Within pyproject's ranges; posix_ipc as scripts/fetch-kvcached.py pins it.
WHEEL_PINS = ("pyzmq==27.3.0", "msgspec==0.23.0", "posix_ipc==1.3.2")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64")
#: What may travel to the device machine: the working tree and the carried files together.
TRAVEL_LIMIT_BYTES = 64 << 20
#: The project's sources: what its wheel is built from.
SOURCES = ("broker", "client", "adapters", "tools", "pyproject.toml", "setup.py")


class CarriedError(Exception):
    """The carried files cannot be used; the message is one line."""


@dataclass(frozen=True)
class Manifest:
    python: str
    files: list[dict]
    source_digest: str

    def path_of(self, folder: Path, role: str) -> list[Path]:
        return [folder / f["path"] for f in self.files if f["role"] == role]


# ----------------------------------------------------------------------------- digests and sizes
def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def source_digest(root: Path) -> str:
    """A digest of the project's sources (names and contents; caches and bytecode left out)."""
    digest = hashlib.sha256()
    for name in SOURCES:
        top = root / name
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for path in files:
            rel = path.relative_to(root).as_posix()
            if "__pycache__" in rel or rel.endswith((".pyc", ".so")):
                continue
            digest.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def folder_bytes(folder: Path) -> int:
    return sum(p.lstat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def tree_bytes(root: Path) -> int | None:
    """What the device tool sends besides the carried files: tracked and untracked-not-ignored files
    (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    total = 0
    for name in filter(None, out.decode(errors="replace").split("\0")):
        try:
            total += (root / name).lstat().st_size
        except OSError:
            continue  # deleted in the tree, still in the index
    return total


# ----------------------------------------------------------------------------- prepare (here)
def _fetch_kvcached_module(root: Path):
    spec = importlib.util.spec_from_file_location("fetch_kvcached", root / "scripts" / "fetch-kvcached.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(root / "scripts"))  # it imports its sibling pkgindex
    spec.loader.exec_module(module)
    return module


def _pip(*args: str, env: dict | None = None) -> None:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise CarriedError(f"pip {args[0]} failed: {lines[-1] if lines else done.returncode}")


def prepare(root: Path, folder: Path, python_version: str = PYTHON_VERSION, log=print) -> Manifest:
    """Gather every carried file into ``folder`` (emptied first) and write its manifest."""
    wheels, sdists = folder / "wheels", folder / "sdist"
    for sub in (wheels, sdists):
        sub.mkdir(parents=True, exist_ok=True)
        for old in sub.iterdir():
            old.unlink()
    (folder / MANIFEST).unlink(missing_ok=True)
    log(f"gpu-check --prepare: wheels for CPython {python_version} (manylinux x86_64): {', '.join(WHEEL_PINS)}")
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    _pip("download", "--no-deps", "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
         *platforms, "-d", str(wheels), *WHEEL_PINS)
    log("gpu-check --prepare: the project's wheel (pip wheel .)")
    digest = source_digest(root)
    env = {k: v for k, v in os.environ.items() if k != "KVCACHED_BROKER_COMPILE"}  # pure Python: any CPython
    _pip("wheel", "--no-deps", "-w", str(wheels), str(root), env=env)
    fetch = _fetch_kvcached_module(root)
    log(f"gpu-check --prepare: {fetch.SDIST} (sha256-pinned)")
    (sdists / fetch.SDIST).write_bytes(fetch.download_sdist())
    files = []
    for path in sorted(wheels.iterdir()) + sorted(sdists.iterdir()):
        role = "sdist" if path.parent == sdists else ("project" if path.name.startswith("kvcached_broker-") else "wheel")
        files.append({"path": path.relative_to(folder).as_posix(), "role": role, "bytes": path.stat().st_size,
                      "sha256": sha256_of(path)})
    manifest = Manifest(python_version, files, digest)
    (folder / MANIFEST).write_text(json.dumps({"python": python_version, "source_digest": digest, "files": files,
                                               "created": time.strftime("%Y-%m-%d %H:%M:%S %z")}, indent=1) + "\n")
    return manifest


def sizes_report(root: Path, folder: Path) -> tuple[str, bool]:
    """Lines saying what the carried files and the tree weigh against the 64 MiB; whether it fits."""
    carried = folder_bytes(folder)
    tree = tree_bytes(root)
    lines = [f"carried files ({folder}): {carried / (1 << 20):.2f} MiB"]
    if tree is None:
        lines.append("working tree: unknown (not a git checkout)")
        fits = carried <= TRAVEL_LIMIT_BYTES
    else:
        total = carried + tree
        fits = total <= TRAVEL_LIMIT_BYTES
        lines.append(f"working tree (tracked and untracked, not ignored): {tree / (1 << 20):.2f} MiB")
        lines.append(f"together: {total / (1 << 20):.2f} MiB of the {TRAVEL_LIMIT_BYTES >> 20} MiB that may travel: "
                     f"{'fits' if fits else 'TOO BIG'}")
    return "\n".join(lines), fits


# ----------------------------------------------------------------------------- verify and install (there)
def verify(folder: Path) -> Manifest:
    """The manifest, once every file it names is present with its size and sha256; CarriedError otherwise."""
    path = folder / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CarriedError(f"no {path}: run scripts/gpu-check --prepare first, and carry {CARRIED}") from None
    except (OSError, ValueError) as exc:
        raise CarriedError(f"{path} cannot be read: {exc}") from None
    try:
        manifest = Manifest(str(data["python"]), list(data["files"]), str(data["source_digest"]))
        entries = [(f["path"], f["role"], int(f["bytes"]), str(f["sha256"])) for f in manifest.files]
    except (KeyError, TypeError, ValueError) as exc:
        raise CarriedError(f"{path} is not a gpu-check manifest ({type(exc).__name__}: {exc})") from None
    for rel, _role, size, sha in entries:
        file = folder / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise CarriedError(f"{path} names a file outside {folder}: {rel}")
        if not file.is_file():
            raise CarriedError(f"carried file missing: {file} (run scripts/gpu-check --prepare again)")
        if file.stat().st_size != size or sha256_of(file) != sha:
            raise CarriedError(f"carried file altered: {file} does not match its manifest (run --prepare again)")
    for role in ("wheel", "project", "sdist"):
        if not any(e[1] == role for e in entries):
            raise CarriedError(f"{path} lists no {role} file (run scripts/gpu-check --prepare again)")
    return manifest


def check_python(manifest: Manifest) -> None:
    here = ".".join(platform.python_version_tuple()[:2])
    if here != manifest.python:
        raise CarriedError(f"the carried wheels are for CPython {manifest.python}, this is {here}: "
                           f"run scripts/gpu-check --prepare --python-version {here}")


def install(root: Path, folder: Path, manifest: Manifest, site: Path, workdir: Path) -> dict[str, str]:
    """Install the carried wheels into ``site`` (with the project's wheel rebuilt from the tree if
    the tree changed since it was built); what was done, for the run's record."""
    project = manifest.path_of(folder, "project")
    done = {"wheels": ", ".join(p.name for p in manifest.path_of(folder, "wheel"))}
    if source_digest(root) != manifest.source_digest:
        built = workdir / "project-wheel"
        built.mkdir(parents=True, exist_ok=True)
        _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(built), str(root))
        project = sorted(built.glob("kvcached_broker-*.whl"))
        done["project_wheel"] = "rebuilt here from the tree (it changed since --prepare)"
    else:
        done["project_wheel"] = "carried (built from this tree)"
    _pip("install", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--target", str(site),
         *map(str, manifest.path_of(folder, "wheel") + project))
    return done
