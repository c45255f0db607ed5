"""The supported releases: the one table that the patches, the scripts, the tests and the README read.

Per runtime: the range of releases the adapters support, the *layout gates* (the first release
of each module layout a patch depends on), the releases the suite tests on CPU against their real
classes (one *overlay* each, built by ``scripts/adapter-envs.sh`` from its pins there), the
upstream tests run against them (``scripts/upstream-tests.py``, pinned by the sdist's sha256),
and, for vLLM, the releases kvcached mode supports and is tested on.

Adding a release: its overlay here (and a wider range if it is the newest), its pins
(``PINS_<runtime>_<version>`` in ``scripts/adapter-envs.sh``), and a gate for any layout it
changes.  ``tests/adapters/test_support_table.py`` checks that the patches, the scripts, the upstream
manifest and the README's support table agree with this module.

Only the standard library and :mod:`.versions` are imported here: the shell scripts read this
table through ``scripts/support.py``, without importing the package or a runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .versions import in_range, parse


@dataclass(frozen=True)
class Range:
    """``minimum <= version < below``."""

    minimum: str
    below: str

    def __contains__(self, version: object) -> bool:
        return isinstance(version, str) and in_range(version, self.minimum, self.below)

    def __str__(self) -> str:
        return f">={self.minimum},<{self.below}"


@dataclass(frozen=True)
class Upstream:
    """The release's own tests, from its sdist on the package index (pinned by sha256)."""

    sdist: str
    sha256: str


@dataclass(frozen=True)
class Overlay:
    """One release the suite runs against its real classes (``.adapter-envs/<runtime>-<version>``)."""

    runtime: str
    version: str
    #: test paths its adapter suite runs (relative to the repo root); empty: every test marked for the runtime
    suite: tuple[str, ...] = ()
    upstream: Upstream | None = None

    @property
    def name(self) -> str:
        return f"{self.runtime}-{self.version}"


@dataclass(frozen=True)
class Runtime:
    name: str  # the distribution, the module and the patches' prefix: "sglang", "vllm", "kvcached"
    label: str  # as users write it: "SGLang"
    supported: Range
    #: layout name -> the first release with that layout (a patch for it applies from there on)
    gates: dict[str, str] = field(default_factory=dict)
    overlays: tuple[Overlay, ...] = ()
    #: the releases kvcached 0.1.6 supports for this runtime inside ``supported``, and those kvcached
    #: mode is tested on (a ``kvcached+<runtime>-<version>`` overlay each); None: not in kvcached mode
    kvcached_mode: Range | None = None
    kvcached_overlays: tuple[str, ...] = ()
    #: version -> the test paths its kvcached mode overlay runs (absent: every test marked runtime("kvcached", <runtime>))
    kvcached_suites: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def supports(self, version: str | None) -> bool:
        return version is not None and version in self.supported

    def at_least(self, gate: str, version: str) -> bool:
        """True if ``version`` has the layout ``gate`` names (KeyError for an unknown gate)."""
        return parse(version) >= parse(self.gates[gate])

    def overlay(self, version: str) -> Overlay:
        for overlay in self.overlays:
            if overlay.version == version:
                return overlay
        raise KeyError(f"{self.name} {version} has no overlay in adapters/support.py")

    def tested(self) -> list[str]:
        return [o.version for o in self.overlays]


VLLM_SUITE = "tests/adapters/vllm"

SGLANG = Runtime(
    name="sglang",
    label="SGLang",
    supported=Range("0.5.12", "0.5.24"),  # 0.5.12: the first release with DeepSeek-V4 pools
    gates={
        "allocator_package": "0.5.13",  # mem_cache/allocator.py becomes a package; weight_updater
        "configurator": "0.5.16",  # KVCacheConfigurator replaces the model runner's KV mixin
        "request_window": "0.5.21",  # DeepSeek-V4.1's RequestWindow workspace
    },
    overlays=(
        Overlay("sglang", "0.5.12"),
        Overlay("sglang", "0.5.13.post1"),
        Overlay("sglang", "0.5.23"),
    ),
    kvcached_mode=Range("0.5.12", "0.5.24"),
    kvcached_overlays=("0.5.23",),
)

VLLM = Runtime(
    name="vllm",
    label="vLLM",
    supported=Range("0.19.1", "0.35"),
    gates={
        "graphs_in_peak": "0.21.0",  # the CUDA graph estimate is counted in peak_activation_memory
        "shared_buffer": "0.29.0",  # one backing buffer: worker.utils.allocate_kv_cache; no cross-layer mixin
        "hisparse": "0.30.0",  # v1.hisparse.binding binds allocate_kv_cache
        "discard": "0.33.0",  # Worker.discard(tags)
        "v2_runner_only": "0.34.0",  # v1/worker/gpu_model_runner.py (the V1 runner) removed
        "extensible_kv_cache": "0.34.0",  # v1/worker/extensible_kv_cache.py; allocate_kv_cache(allocate=)
    },
    overlays=(
        Overlay("vllm", "0.19.1", upstream=Upstream(
            "vllm-0.19.1.tar.gz", "9fb88ce6b50991eba41d183584f65f51d7f6015d86a42cdabf79c1c8bd5d66fa")),
        # the HiSparse binding before the shared-buffer patch's old gate; kvcached mode's newest vLLM
        Overlay("vllm", "0.30.0", suite=(f"{VLLM_SUITE}/test_vllm_reservations.py", f"{VLLM_SUITE}/test_vllm_patches.py")),
        Overlay("vllm", "0.33.0", upstream=Upstream(
            "vllm-0.33.0.tar.gz", "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112")),
        Overlay("vllm", "0.34.0", upstream=Upstream(
            "vllm-0.34.0.tar.gz", "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113")),
    ),
    kvcached_mode=Range("0.19.1", "0.31"),  # kvcached 0.1.6 has no runner adapter past vLLM 0.30
    kvcached_overlays=("0.19.1", "0.30.0"),
    # 0.30.0: kvcached's Model Runner V2 layout; the board's lifetime is the same on every release
    kvcached_suites={"0.30.0": tuple(f"tests/adapters/vllm/{name}.py" for name in
                                     ("test_tp_broadcast", "test_prefix_eviction", "test_coexistence",
                                      "test_kvcached_vllm_range"))},
)

KVCACHED = Runtime(
    name="kvcached",
    label="kvcached",
    supported=Range("0.1.6", "0.1.7"),
    overlays=(Overlay("kvcached", "0.1.6"),),
)

RUNTIMES: dict[str, Runtime] = {r.name: r for r in (SGLANG, VLLM, KVCACHED)}
#: the serving runtimes (kvcached is an elastic KV pool inside one of them)
SERVING = ("sglang", "vllm")


def runtime(name: str) -> Runtime:
    return RUNTIMES[name]


def overlays() -> list[Overlay]:
    """Every runtime overlay, in build order."""
    return [o for r in RUNTIMES.values() for o in r.overlays]


def kvcached_mode_overlays() -> list[str]:
    """``kvcached+<runtime>-<version>``: kvcached's Python code on one path with the runtime's overlay."""
    return [f"kvcached+{r.name}-{v}" for r in RUNTIMES.values() for v in r.kvcached_overlays]


def kvcached_mode_suite(name: str) -> tuple[str, ...]:
    """The test paths kvcached mode overlay ``name`` (``kvcached+vllm-0.30.0``) runs; empty: its
    runtime's whole kvcached suite.  KeyError if the table has no such overlay."""
    if name not in kvcached_mode_overlays():
        raise KeyError(f"no overlay {name!r} in adapters/support.py")
    runtime, _, version = name.removeprefix("kvcached+").partition("-")
    return RUNTIMES[runtime].kvcached_suites.get(version, ())


def test_overlays() -> list[str]:
    """Every overlay a suite runs in, in order: each runtime's, then kvcached mode's."""
    return [o.name for o in overlays()] + kvcached_mode_overlays()


def newest_overlays() -> list[str]:
    """What ``make test`` runs (``make test-adapters``): each runtime's newest overlay, the
    last in its row (the table lists releases oldest first)."""
    return [r.overlays[-1].name for r in RUNTIMES.values() if r.overlays]


def newest_serving_overlays() -> list[str]:
    """The serving runtimes' newest overlays, which ``make test`` builds (``make adapter-envs-newest``)."""
    return [r.overlays[-1].name for r in RUNTIMES.values() if r.overlays and r.name in SERVING]


def matrix_overlays() -> list[str]:
    """What ``make test-matrix`` runs: every other overlay, in :func:`test_overlays`' order
    (``make test`` and ``make test-matrix`` together run each overlay once)."""
    newest = set(newest_overlays())
    return [name for name in test_overlays() if name not in newest]


def find_overlay(name: str) -> Overlay:
    """The overlay named ``name`` (``vllm-0.34.0``); KeyError if the table has none."""
    for overlay in overlays():
        if overlay.name == name:
            return overlay
    raise KeyError(f"no overlay {name!r} in adapters/support.py")
