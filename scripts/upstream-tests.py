#!/usr/bin/env python3
"""Run upstream's own allocator and block-pool tests with the adapter patches off, then on.

    upstream-tests.py fetch ENVS_DIR              download the files tests/adapters/upstream/MANIFEST.tsv
                                                  pins (needs raw.githubusercontent.com), check sha256
    upstream-tests.py run PYTHON ENVS_DIR OVERLAY run the overlay's files twice; fail on any difference

Upstream code is never committed: the files live in ``ENVS_DIR/upstream/<repo>@<commit12>/``.
The pinned commits need not be the overlay's release, so some upstream tests may fail for
version reasons; they fail alike in both runs.  What fails the run is a test whose outcome
changes when the patches are on (for example a double free that no longer reaches
``SGLANG_DEBUG_MEMORY_POOL``'s check).  Files that were not fetched are reported and
skipped, unless ``KVCACHED_UPSTREAM_REQUIRED=1``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "tests" / "adapters" / "upstream"
MANIFEST = HERE / "MANIFEST.tsv"


@dataclass(frozen=True)
class Pinned:
    overlay: str
    repository: str
    commit: str
    path: str
    sha256: str

    def local(self, envs: Path) -> Path:
        return envs / "upstream" / f"{self.repository.split('/')[1]}@{self.commit[:12]}" / self.path

    def url(self) -> str:
        return f"https://raw.githubusercontent.com/{self.repository}/{self.commit}/{self.path}"

    def check(self, envs: Path) -> str | None:
        """None if the file is there with the pinned hash, else what is wrong."""
        path = self.local(envs)
        if not path.exists():
            return f"{path} is not fetched"
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        return None if digest == self.sha256 else f"{path}: sha256 {digest}, pinned {self.sha256}"


def manifest() -> list[Pinned]:
    rows = [line.split("\t") for line in MANIFEST.read_text().splitlines() if line and not line.startswith("#")]
    return [Pinned(*row) for row in rows]


def fetch(envs: Path) -> int:
    status = 0
    for pinned in {(p.repository, p.commit, p.path): p for p in manifest()}.values():
        if pinned.check(envs) is None:
            continue
        target = pinned.local(envs)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            with urllib.request.urlopen(pinned.url(), timeout=30) as response:
                target.write_bytes(response.read())
        except OSError as exc:
            print(f"upstream-tests: cannot fetch {pinned.url()}: {exc}", file=sys.stderr)
            status = 1
            continue
        problem = pinned.check(envs)
        if problem:
            print(f"upstream-tests: {problem}", file=sys.stderr)
            target.unlink()
            status = 1
    return status


def _pytest(python: str, envs: Path, overlay: str, files: list[Path], patches: str, outcomes: Path) -> int:
    runtime = overlay.split("-", 1)[0]
    extra = [str(HERE)] + ([str(HERE / "stubs")] if runtime == "sglang" else [])
    command = (
        f'set -a; . "{envs}/{overlay}.env"; set +a; export PYTHONPATH="$PYTHONPATH:{":".join(extra)}"; '
        f'exec "{python}" -m pytest -q -p no:cacheprovider -p kvcached_patches_on -c "{HERE}/pytest.ini" '
        f'--rootdir "{envs}/upstream" ' + " ".join(f'"{f}"' for f in files)
    )
    env = {**os.environ, "KVCACHED_UPSTREAM_RUNTIME": runtime, "KVCACHED_UPSTREAM_PATCHES": patches,
           "KVCACHED_UPSTREAM_OUTCOMES": str(outcomes), "TRITON_INTERPRET": "1"}
    for name in ("ENABLE_KVCACHED", "KVCACHED_AUTOPATCH", "KVCACHED_REQUIRE"):
        env.pop(name, None)
    done = subprocess.run(["bash", "-c", command], env=env, cwd=envs / "upstream", capture_output=True, text=True)
    summary = [line for line in done.stdout.splitlines() if " passed" in line or " failed" in line or "error" in line]
    print(f"  patches {patches}: {summary[-1] if summary else done.stdout[-500:] + done.stderr[-1500:]}")
    return done.returncode


def run(python: str, envs: Path, overlay: str) -> int:
    pinned = [p for p in manifest() if p.overlay == overlay]
    if not pinned:
        return 0
    problems = [problem for p in pinned if (problem := p.check(envs))]
    if problems:
        print(f"=== upstream tests: {overlay}: not run ({problems[0]}; run scripts/upstream-tests.py fetch {envs})")
        hashes_wrong = any("sha256" in problem for problem in problems)
        return 1 if hashes_wrong or os.environ.get("KVCACHED_UPSTREAM_REQUIRED") == "1" else 0
    print(f"=== upstream tests: {overlay} ({len(pinned)} files, adapter patches off, then on) ===")
    files = [p.local(envs) for p in pinned]
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for patches in ("off", "on"):
            out = Path(tmp) / f"{patches}.json"
            _pytest(python, envs, overlay, files, patches, out)
            if not out.exists():
                print(f"  patches {patches}: no outcomes were written", file=sys.stderr)
                return 1
            results[patches] = json.loads(out.read_text())
    off, on = results["off"], results["on"]
    changed = sorted(node for node in set(off) | set(on) if off.get(node) != on.get(node))
    for node in changed:
        print(f"  CHANGED by the patches: {node}: {off.get(node, 'absent')} -> {on.get(node, 'absent')}")
    if not off or changed:
        return 1
    print(f"  {len(on)} upstream tests, the same outcome with and without the patches")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["fetch"] and len(argv) == 2:
        return fetch(Path(argv[1]).resolve())
    if argv[:1] == ["run"] and len(argv) == 4:
        return run(str(Path(argv[1]).absolute()), Path(argv[2]).resolve(), argv[3])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
