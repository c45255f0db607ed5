"""Ships ``kvcached_broker_autopatch.pth`` at the root of site-packages, in regular *and*
editable installs.  kvcached's ``.pth`` silently went missing from editable installs (#470):
setuptools' editable wheels carry only packages, so for them the file is added to the
finished wheel (and to its RECORD) here.  Everything else is in pyproject.toml."""

import base64
import hashlib
import zipfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

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


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
