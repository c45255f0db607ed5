"""Two things pyproject.toml cannot say.

* Ships ``kvcached_broker_autopatch.pth`` at the root of site-packages, in regular *and*
  editable installs.  kvcached's ``.pth`` silently went missing from editable installs (#470):
  setuptools' editable wheels carry only packages, so for them the file is added to the
  finished wheel (and to its RECORD) here.
* With ``KVCACHED_BROKER_COMPILE=1`` in the environment of a (non-editable) install, compiles
  the broker's request core with mypyc: the same modules, as C extensions
  (docs/design.md, "The compiled request core").  pip then fetches mypy for the build.

Everything else is in pyproject.toml."""

import base64
import hashlib
import os
import shutil
import sys
import warnings
import zipfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel
from setuptools.warnings import InformationOnly

PTH = "kvcached_broker_autopatch.pth"
SOURCE = Path(__file__).parent / "adapters" / PTH


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(str(SOURCE), str(Path(self.build_lib) / PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


class EditableWheelWithPth(editable_wheel):
    def run(self):
        with warnings.catch_warnings():
            # setuptools ends every editable install that maps packages through a finder
            # (package-dir) with "Please be careful with folders in your working directory with
            # the same name as your package": a folder named kvcached_broker there would shadow
            # the install.  The repository has none (tests/test_packaging.py keeps it so).
            warnings.filterwarnings("ignore", message="Editable installation", category=InformationOnly)
            super().run()
        for wheel in Path(self.dist_dir).glob("*.whl"):
            _add_to_wheel(wheel, PTH, SOURCE.read_bytes())


def _add_to_wheel(wheel: Path, name: str, data: bytes) -> None:
    with zipfile.ZipFile(wheel) as zf:
        if name in zf.namelist():
            return
        record_name = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        record = zf.read(record_name).decode()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record += f"{name},sha256={digest},{len(data)}\n"
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            if item.filename != record_name:
                dst.writestr(item, src.read(item.filename))
        dst.writestr(name, data)
        dst.writestr(record_name, record)
    tmp.replace(wheel)


#: The request path, compiled by ``KVCACHED_BROKER_COMPILE=1``: pure modules with exact
#: annotations.  msgspec schemas (client/protocol.py, broker/state_records.py) and modules
#: that subclass built-in exceptions stay interpreted; mypyc cannot compile them.
COMPILED_MODULES = [
    "broker/accounts.py", "broker/admin_ops.py", "broker/counters.py", "broker/device_monitor.py",
    "broker/histogram.py", "broker/journal.py", "broker/ledger.py", "broker/lifecycle.py",
    "broker/policy.py", "broker/quotas.py", "broker/refusals.py", "broker/request_core.py", "broker/session_opener.py",
    "broker/sessions.py", "broker/status.py", "broker/tokens.py", "client/credit.py", "client/units.py",
]
#: What the compiled build needs at build time: mypy (with mypyc), and the libraries whose
#: types the compiled modules use, so that mypy checks them against their real signatures.
BUILD_REQUIREMENTS = ["mypy>=1.13,<3", "msgspec>=0.18,<0.24", "pyzmq>=25,<28"]


def compile_requested() -> bool:
    value = os.environ.get("KVCACHED_BROKER_COMPILE", "").strip()
    if value not in ("", "0", "1"):
        sys.exit(f"KVCACHED_BROKER_COMPILE must be 1 (compile the request core) or 0, not {value!r}")
    return value == "1"


#: The setuptools commands that build extensions (pip's metadata steps need none).
BUILD_COMMANDS = {"bdist_wheel", "build", "build_ext", "install"}


def compiled_extensions() -> list:
    """mypyc's extensions for ``COMPILED_MODULES``, when setuptools is about to build them."""
    if {"editable_wheel", "develop"} & set(sys.argv[1:]):
        sys.exit("KVCACHED_BROKER_COMPILE=1 does not apply to an editable install (its extensions would "
                 "shadow edited sources); install with 'pip install .' or leave the variable unset")
    if not BUILD_COMMANDS & set(sys.argv[1:]):
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        sys.exit(f"KVCACHED_BROKER_COMPILE=1 needs {BUILD_REQUIREMENTS[0]} in the build environment "
                 "(pip installs it; with --no-build-isolation, install it first)")
    # mypyc names a module by its path, so the sources are staged under their installed names
    # (the repository keeps broker/ and client/ at its root).
    root = Path(__file__).parent
    staged = root / "build" / "mypyc-src"
    shutil.rmtree(staged, ignore_errors=True)
    for package in ("broker", "client"):
        shutil.copytree(root / package, staged / "kvcached_broker" / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    (staged / "kvcached_broker" / "__init__.py").write_text("")
    paths = [str(staged / "kvcached_broker" / module) for module in COMPILED_MODULES]
    return mypycify(["--ignore-missing-imports", *paths], opt_level="3", target_dir=str(root / "build" / "mypyc"))


COMPILE = compile_requested()
setup(
    cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth},
    ext_modules=compiled_extensions() if COMPILE else [],
    setup_requires=BUILD_REQUIREMENTS if COMPILE else [],
)
