#!/usr/bin/env python3
"""Run upstream's own allocator and block-pool tests with the adapter patches off, then on.

    upstream-tests.py fetch ENVS_DIR [OVERLAY...]  from the package index in pip's configuration: each
                                                  overlay's sdist (sha256-pinned), only the listed test
                                                  files extracted; stamped, so a second run costs nothing
    upstream-tests.py fetch-github ENVS_DIR        optional extra: the GitHub-pinned files (SGLang's
                                                  allocator test), where raw.githubusercontent.com answers
    upstream-tests.py run PYTHON ENVS_DIR OVERLAY  run the overlay's tests twice; fail on any difference

What runs where is tests/adapters/upstream/MANIFEST.tsv, and the sdists they come from are the overlays'
``upstream`` pins in the table of supported releases (adapters/support.py).  Upstream code is never committed: it lives
in ``ENVS_DIR/upstream/<overlay>/``.  vLLM's tests come from the overlay's own release sdist, so every
selected test must pass in both runs; tests that cannot run here (no GPU, no network for a Hugging
Face model) are deselected in the manifest with a reason.  The GitHub-pinned SGLang file need not be
the overlay's release, so there only a changed outcome fails.

``scripts/adapter-envs.sh`` runs ``fetch``; a fetch that fails prints one line and fails the build,
unless ``KVCACHED_UPSTREAM_OPTIONAL=1`` (then the build goes on, and ``run`` reports the tests as not
run instead of failing).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pkgindex  # scripts/pkgindex.py: the index in pip's configuration, download, sha256
import support  # scripts/support.py: the table of supported releases (adapters/support.py)

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "tests" / "adapters" / "upstream"
MANIFEST = HERE / "MANIFEST.tsv"
OPTIONAL = "KVCACHED_UPSTREAM_OPTIONAL"
#: our own test that covers what SGLang's upstream allocator test checks with the patches on
SGLANG_COVER = ("tests/adapters/sglang/test_sglang_paged_allocator.py::"
                "test_in_debug_mode_a_double_free_reaches_upstreams_own_check")
RUN_TIMEOUT_S = 900


def optional() -> bool:
    return os.environ.get(OPTIONAL, "").strip().lower() not in ("", "0", "false", "no", "off")


@dataclass
class Overlay:
    name: str
    origin: str = ""  # "index" or "github"
    source: str = ""  # the sdist's file name, or OWNER/REPO@COMMIT
    sha256: str = ""  # the sdist's (index)
    tests: list[str] = field(default_factory=list)
    support: list[str] = field(default_factory=list)
    file_sha256: dict[str, str] = field(default_factory=dict)  # github files
    deselect: dict[str, str] = field(default_factory=dict)  # PATH::TEST -> reason

    def dir(self, envs: Path) -> Path:
        return envs / "upstream" / self.name

    def stamp(self) -> str:
        rows = [self.origin, self.source, self.sha256, *self.tests, *self.support]
        return hashlib.sha256("\n".join(rows).encode()).hexdigest()

    def fetched(self, envs: Path) -> str | None:
        """None if the files are there as pinned, else what is wrong."""
        base = self.dir(envs)
        if self.origin == "index":
            complete = base / ".complete"
            if not complete.exists():
                return f"{base} is not fetched"
            if complete.read_text().strip() != self.stamp():
                return f"{base} was fetched for another pin"
            return None
        for path in self.tests + self.support:
            local = base / path
            if not local.exists():
                return f"{local} is not fetched"
            digest = hashlib.sha256(local.read_bytes()).hexdigest()
            if digest != self.file_sha256[path]:
                return f"{local}: sha256 {digest}, pinned {self.file_sha256[path]}"
        return None


def manifest() -> dict[str, Overlay]:
    """What runs where: the index sources from the table of supported releases (each overlay's
    ``upstream`` sdist and sha256, adapters/support.py), the rest from MANIFEST.tsv."""
    overlays: dict[str, Overlay] = {}
    for entry in support.table().overlays():
        if entry.upstream is not None:
            overlays[entry.name] = Overlay(entry.name, "index", entry.upstream.sdist, entry.upstream.sha256)
    for number, line in enumerate(MANIFEST.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        kind, name, *rest = line.split("\t")
        overlay = overlays.setdefault(name, Overlay(name))
        if kind == "source":
            if rest[0] == "index":
                raise SystemExit(f"upstream-tests: {MANIFEST}:{number}: index sources are the overlays' `upstream` "
                                 f"in adapters/support.py, not rows here")
            overlay.origin, overlay.source, overlay.sha256 = rest
        elif kind in ("test", "support"):
            (overlay.tests if kind == "test" else overlay.support).append(rest[0])
            if len(rest) > 1:
                overlay.file_sha256[rest[0]] = rest[1]
        elif kind == "deselect":
            overlay.deselect[rest[0]] = rest[1]
        else:
            raise SystemExit(f"upstream-tests: {MANIFEST}:{number}: unknown row kind {kind!r}")
    for overlay in overlays.values():
        if not overlay.origin:
            raise SystemExit(f"upstream-tests: {MANIFEST}: {overlay.name} has no source (its overlay's `upstream` "
                             f"in adapters/support.py, or a `source` row here)")
    return overlays


def log(message: str) -> None:
    print(f"[upstream-tests] {message}", file=sys.stderr)


# ------------------------------------------------------------------ fetch (the package index)
def _extract(overlay: Overlay, sdist: bytes, target: Path) -> None:
    """Only the manifest's files, from ``<name>-<version>/`` in the sdist."""
    prefix = overlay.source.removesuffix(".tar.gz") + "/"
    wanted = set(overlay.tests + overlay.support)
    with tarfile.open(fileobj=io.BytesIO(sdist), mode="r:gz") as tar:
        for member in tar.getmembers():
            relative = member.name[len(prefix):] if member.name.startswith(prefix) else None
            if relative not in wanted or not member.isfile():
                continue
            source = tar.extractfile(member)
            assert source is not None
            out = target / relative
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(source.read())
            wanted.discard(relative)
    if wanted:
        raise pkgindex.FetchError(f"{overlay.source} lacks {', '.join(sorted(wanted))}")


def fetch(envs: Path, names: list[str]) -> int:
    overlays = manifest()
    config = None
    for name in names or sorted(overlays):
        overlay = overlays.get(name)
        if overlay is None or overlay.origin != "index":
            continue
        if overlay.fetched(envs) is None:
            log(f"{name}: up to date")
            continue
        started = time.monotonic()
        config = pkgindex.pip_config() if config is None else config
        target = overlay.dir(envs)
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        try:
            sdist = pkgindex.download(overlay.source.split("-")[0], overlay.source, overlay.sha256, config, log)
            _extract(overlay, sdist, partial)
        except (pkgindex.FetchError, OSError, tarfile.TarError) as exc:
            shutil.rmtree(partial, ignore_errors=True)
            what = f"upstream-tests: cannot fetch {name}'s upstream tests from the package index: {exc}"
            if optional():
                print(f"{what} (going on without them: {OPTIONAL}=1)", file=sys.stderr)
                continue
            print(f"{what} (set {OPTIONAL}=1 to build without them)", file=sys.stderr)
            return 1
        (partial / ".complete").write_text(overlay.stamp() + "\n")
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
        log(f"{name}: {len(overlay.tests) + len(overlay.support)} files from {overlay.source} "
            f"in {time.monotonic() - started:.1f}s into {target}")
    return 0


# ------------------------------------------------------------------ fetch-github (optional)
def fetch_github(envs: Path) -> int:
    status = 0
    for overlay in manifest().values():
        if overlay.origin != "github":
            continue
        repository, commit = overlay.source.split("@")
        for path in overlay.tests + overlay.support:
            local = overlay.dir(envs) / path
            if local.exists() and hashlib.sha256(local.read_bytes()).hexdigest() == overlay.file_sha256[path]:
                continue
            url = f"https://raw.githubusercontent.com/{repository}/{commit}/{path}"
            try:
                with urllib.request.urlopen(url, timeout=30) as response:
                    data = response.read()
            except OSError as exc:
                print(f"upstream-tests: cannot fetch {url}: {exc}", file=sys.stderr)
                status = 1
                continue
            digest = hashlib.sha256(data).hexdigest()
            if digest != overlay.file_sha256[path]:
                print(f"upstream-tests: {url}: sha256 {digest}, pinned {overlay.file_sha256[path]}", file=sys.stderr)
                status = 1
                continue
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(data)
            log(f"{overlay.name}: {path}")
    return status


# ------------------------------------------------------------------ run
def _start(python: str, envs: Path, overlay: Overlay, patches: str, outcomes: Path, log_path: Path) -> subprocess.Popen:
    runtime = overlay.name.split("-", 1)[0]
    extra = [str(HERE)] + ([str(HERE / "stubs")] if runtime == "sglang" else [])
    base = overlay.dir(envs)
    command = (
        f'set -a; . "{envs}/{overlay.name}.env"; set +a; export PYTHONPATH="$PYTHONPATH:{":".join(extra)}"; '
        f'exec "{python}" -m pytest -q -p no:cacheprovider -p kvcached_patches_on -c "{HERE}/pytest.ini" '
        f'--rootdir "{base}" ' + " ".join(f'"{path}"' for path in overlay.tests)
    )
    env = {**os.environ, "KVCACHED_UPSTREAM_RUNTIME": runtime, "KVCACHED_UPSTREAM_PATCHES": patches,
           "KVCACHED_UPSTREAM_OUTCOMES": str(outcomes), "KVCACHED_UPSTREAM_DESELECT": json.dumps(overlay.deselect),
           "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    for name in ("ENABLE_KVCACHED", "KVCACHED_AUTOPATCH", "KVCACHED_REQUIRE"):
        env.pop(name, None)
    with open(log_path, "w") as log_file:
        return subprocess.Popen(["bash", "-c", command], env=env, cwd=base, stdout=log_file,
                                stderr=subprocess.STDOUT, text=True)


def _finish(process: subprocess.Popen, log_path: Path, deadline: float) -> tuple[int, str]:
    """Wait for one pytest run; its exit status and summary line (or the tail of its output)."""
    try:
        rc = process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return 124, f"timed out after {RUN_TIMEOUT_S}s"
    output = log_path.read_text(errors="replace")
    summary = [line for line in output.splitlines() if " passed" in line or " failed" in line or " error" in line]
    return rc, summary[-1].strip("= ") if summary else output[-2000:]


def _sglang_not_run(name: str, why: str) -> int:
    print(f"=== upstream tests: {name}: NOT RUN: SGLang's own allocator test (test_allocator_cpu.py) is not on "
          f"the package index (its wheels ship no tests; PyPI has no 0.5.x sdist), and {why}")
    print(f"  covered here instead by {SGLANG_COVER} (run above)")
    return 0


def run(python: str, envs: Path, name: str) -> int:
    overlay = manifest().get(name)
    if overlay is None:
        if name.startswith("sglang-"):
            return _sglang_not_run(name, "GitHub's copy is pinned for sglang-0.5.23 only")
        return 0
    problem = overlay.fetched(envs)
    if problem and overlay.origin == "github" and "sha256" not in problem:
        return _sglang_not_run(name, f"GitHub's copy is not fetched ({envs.name}/upstream/{name}; "
                                     f"scripts/upstream-tests.py fetch-github {envs}, where GitHub answers)")
    if problem:
        fix = f"scripts/upstream-tests.py fetch {envs} {name}, or make adapter-envs"
        if overlay.origin == "index" and optional() and "sha256" not in problem:
            print(f"=== upstream tests: {name}: NOT RUN ({problem}; {OPTIONAL}=1; {fix})")
            return 0
        print(f"=== upstream tests: {name}: FAILED: {problem} ({fix})")
        return 1
    strict = overlay.origin == "index"
    print(f"=== upstream tests: {name} ({overlay.source}: {len(overlay.tests)} files, adapter patches off, then on) ===")
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        # both runs at once: they share nothing (a process each), and the imports dominate
        runs = {patches: _start(python, envs, overlay, patches, Path(tmp) / f"{patches}.json",
                                Path(tmp) / f"{patches}.log") for patches in ("off", "on")}
        results = {}
        for patches, process in runs.items():
            rc, summary = _finish(process, Path(tmp) / f"{patches}.log", started + RUN_TIMEOUT_S)
            print(f"  patches {patches}: {summary}")
            out = Path(tmp) / f"{patches}.json"
            if not out.exists():
                print(f"  patches {patches}: no outcomes were written (pytest exited {rc})")
                for other in runs.values():
                    other.kill()
                return 1
            results[patches] = json.loads(out.read_text())
    print(f"  both runs, side by side: {time.monotonic() - started:.0f}s")
    off, on = results["off"]["outcomes"], results["on"]["outcomes"]
    print(f"  adapter patches applied in the 'on' run: {', '.join(results['on'].get('applied', [])) or 'none'}")
    status = 0
    matched = results["off"]["deselected"]
    for entry in overlay.deselect:
        if not matched.get(entry):
            print(f"  STALE deselect entry in {MANIFEST.name}, it matches no test: {entry}")
            status = 1
    if overlay.deselect:
        reasons: dict[str, list[str]] = {}
        for entry, reason in overlay.deselect.items():
            reasons.setdefault(reason, []).append(entry.rsplit("::", 1)[-1])
        for reason, tests in reasons.items():
            count = sum(matched.get(entry, 0) for entry in overlay.deselect if overlay.deselect[entry] == reason)
            print(f"  deselected in both runs, {count} tests ({reason}): {', '.join(tests)}")
    changed = sorted(node for node in set(off) | set(on) if off.get(node) != on.get(node))
    for node in changed:
        print(f"  CHANGED by the patches: {node}: {off.get(node, 'absent')} -> {on.get(node, 'absent')}")
    failing = sorted(node for node in set(off) & set(on) if off[node] == on[node] == "failed")
    if strict:
        for node in failing:
            print(f"  FAILS without the patches too (the overlay's own release; deselect it in "
                  f"{MANIFEST.name} with a reason if it cannot run here): {node}")
    if not off or changed or (strict and failing):
        return 1
    counts = {outcome: list(on.values()).count(outcome) for outcome in sorted(set(on.values()))}
    print(f"  {len(on)} upstream tests ({', '.join(f'{n} {o}' for o, n in counts.items())}), "
          f"the same outcome with and without the patches")
    return status


def main(argv: list[str]) -> int:
    if argv[:1] == ["fetch"] and len(argv) >= 2:
        return fetch(Path(argv[1]).resolve(), argv[2:])
    if argv[:1] == ["fetch-github"] and len(argv) == 2:
        return fetch_github(Path(argv[1]).resolve())
    if argv[:1] == ["run"] and len(argv) == 4:
        return run(str(Path(argv[1]).absolute()), Path(argv[2]).resolve(), argv[3])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
