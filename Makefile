# Everything a fresh machine needs: `make demo` runs the demo, `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Every install pins what it installs (pip itself, the test dependencies and theirs, and what
# a build installs) to the versions in constraints/, per supported Python; `make constraints`
# resolves them again (scripts/pythons.py).
CONSTRAINTS := constraints/test.txt
BUILD_CONSTRAINTS := constraints/build.txt
PINNED := -c $(CONSTRAINTS) --build-constraint $(BUILD_CONSTRAINTS)

ENVS := .adapter-envs
# The demo and the hand-over benchmark (tools/kvcached_sim): torch, a CPU build (the pin resolves to
# the local CPU wheel; never unpinned), and kvcached 0.1.6's Python code (scripts/fetch-kvcached.py).
TORCH_PIN := torch==2.13.0
KVCACHED_SIM := $(ENVS)/kvcached-0.1.6
SIM_STAMP := $(VENV)/.kvcached-sim
SIM_LOG := $(VENV)/kvcached-sim.log

# The request core compiled by mypyc (setup.py, KVCACHED_BROKER_COMPILE=1), in a venv of its own:
# the editable .venv stays interpreted, so an edited source is never shadowed by a stale extension.
# Rebuilt when any source of the package changes (it is installed as a wheel, not editable).
CVENV := .venv-compiled
CPY := $(CVENV)/bin/python
CSTAMP := $(CVENV)/.installed
WHEELS := build/compiled-wheel

# `make bench CORE=compiled` and `make chaos CORE=compiled` run against the compiled request core
# (the hand-over benchmark needs torch, which only .venv has: there it is skipped).
CORE ?= interpreted
ifeq ($(CORE),compiled)
BENCH_STAMP := $(CSTAMP)
BENCH_PY := $(CPY)
else ifeq ($(CORE),interpreted)
BENCH_STAMP := $(STAMP)
BENCH_PY := $(PY)
else
$(error CORE must be interpreted or compiled, not '$(CORE)')
endif

.PHONY: demo test lint test-core test-compiled test-adapters test-matrix test-pythons adapter-envs adapter-envs-newest bench chaos replay gpu-check gpu-check-simulate clean constraints canary

$(STAMP): pyproject.toml setup.py adapters/kvcached_broker_autopatch.pth $(CONSTRAINTS) $(BUILD_CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) --upgrade pip
	$(PY) -m pip install --quiet $(PINNED) -e '.[test]'
	touch $(STAMP)

$(CSTAMP): pyproject.toml setup.py $(shell find broker client adapters tools -name '*.py' -o -name '*.json' -o -name '*.toml' 2>/dev/null) $(CONSTRAINTS) $(BUILD_CONSTRAINTS)
	test -x $(CPY) || $(PYTHON) -m venv $(CVENV)
	$(CPY) -m pip install --quiet -c $(CONSTRAINTS) --upgrade pip
	rm -rf $(WHEELS)
	@echo "compiling the request core with mypyc (about a minute)"
	KVCACHED_BROKER_COMPILE=1 $(CPY) -m pip wheel --quiet --no-deps --build-constraint $(BUILD_CONSTRAINTS) --wheel-dir $(WHEELS) .
	$(CPY) -m pip install --quiet --force-reinstall --no-deps $(WHEELS)/*.whl
	$(CPY) -m pip install --quiet $(PINNED) "$$(ls $(WHEELS)/*.whl)[test]"
	touch $(CSTAMP)

# The lint tools (pyproject's `lint` extra) in .venv: mypy at the version that compiles the
# request core (constraints/build.txt), ruff at constraints/lint.txt's.
LINT_STAMP := $(VENV)/.lint
$(LINT_STAMP): $(STAMP) constraints/lint.txt
	$(PY) -m pip install --quiet $(PINNED) -c $(BUILD_CONSTRAINTS) -c constraints/lint.txt -e '.[lint]'
	touch $(LINT_STAMP)

# One venv per other supported Python (pyproject.toml's classifiers), editable and interpreted,
# for `make test-pythons`; the interpreter comes from pyenv or PATH (scripts/pythons.py find).
.venv-py%/.installed: pyproject.toml setup.py adapters/kvcached_broker_autopatch.pth $(CONSTRAINTS) $(BUILD_CONSTRAINTS) | $(STAMP)
	rm -rf .venv-py$*
	py=$$($(PY) scripts/pythons.py find $*) && "$$py" -m venv .venv-py$*
	.venv-py$*/bin/python -m pip install --quiet -c $(CONSTRAINTS) --upgrade pip
	.venv-py$*/bin/python -m pip install --quiet $(PINNED) -e '.[test]'
	touch $@

# Idempotent: once stamped it is not run again (`make clean` or deleting the stamp redoes it).
$(SIM_STAMP): $(STAMP) scripts/fetch-kvcached.py
	@echo "preparing the demo: torch (CPU) and kvcached 0.1.6's Python code, once (log: $(SIM_LOG))"
	@{ $(PY) -m pip show torch >/dev/null 2>&1 || $(PY) -m pip install --quiet -c $(CONSTRAINTS) '$(TORCH_PIN)'; } >$(SIM_LOG) 2>&1
	@$(PY) scripts/fetch-kvcached.py $(ENVS) >>$(SIM_LOG) 2>&1
	@touch $(SIM_STAMP)

# The whole mission on one simulated GPU, live (tools/demo.py): a DeepSeek-V4-shaped server beside
# two kvcached pools; if torch or kvcached cannot be had, the three-worker demo (the demo says
# which it shows, and why, in one line).
demo: $(STAMP)
	@$(MAKE) -s --no-print-directory $(SIM_STAMP) || echo "could not prepare the demo's kvcached pools (see $(SIM_LOG))"
	KVCACHED_BROKER_KVCACHED_PATH=$(abspath $(KVCACHED_SIM)) $(VENV)/bin/kvcached-broker demo $(DEMO_ARGS)

# pytest-xdist's workers for the suites: one per core (`make test TEST_JOBS=0` runs them in one
# process, in file order).  Every test waits on events, so the suites pass however many run at once.
TEST_JOBS ?= auto
export TEST_JOBS

# The developer's suite: the lint and type gates, the environments (so the core's torch-using
# tests run too), then the core, then the adapters against each runtime's newest supported
# release.  Every other release, upstream's own tests and kvcached mode inside each runtime are
# `make test-matrix`; the compiled request core is `make test-compiled`.  .ci/run runs all three.
test: lint adapter-envs-newest test-core test-adapters

# ruff on the whole tree; mypy on the package (strict's flags on broker/ and client/), staged
# under its installed names (the source folders are kvcached_broker.* only through pyproject's
# package-dir).  Configured in pyproject.
lint: $(LINT_STAMP)
	$(PY) -m ruff check --quiet .
	rm -rf build/typecheck/kvcached_broker && mkdir -p build/typecheck/kvcached_broker
	for d in broker client adapters tools; do ln -s ../../../$$d build/typecheck/kvcached_broker/$$d; done
	cd build/typecheck && ../../$(PY) -m mypy --config-file ../../pyproject.toml --cache-dir .mypy_cache -p kvcached_broker

test-core: $(STAMP)
	KVCACHED_BROKER_EXPECT_COMPILED=0 $(PY) -m pytest -q -n $(TEST_JOBS)

# The core suite again against the compiled request core (no torch there: its tests skip).
test-compiled: $(CSTAMP)
	KVCACHED_BROKER_EXPECT_COMPILED=1 $(CPY) -m pytest -q -n $(TEST_JOBS) -p no:cacheprovider

# The core suite on every supported Python but .venv's (no torch: its tests skip), about three
# minutes each on 2 cores; `make test-pythons PYTHONS="3.12"` picks them.  .ci/run runs it
# after `make test`.
test-pythons: $(STAMP)
	@main=$$($(PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])') && \
	versions="$(or $(PYTHONS),$$($(PY) scripts/pythons.py versions))" && \
	for v in $$versions; do \
		[ "$$v" = "$$main" ] && [ -z "$(PYTHONS)" ] && continue; \
		echo "== the core suite on Python $$v"; \
		$(MAKE) --no-print-directory .venv-py$$v/.installed && \
		KVCACHED_BROKER_EXPECT_COMPILED=0 .venv-py$$v/bin/python -m pytest -q -n $(TEST_JOBS) -p no:cacheprovider \
			|| exit 1; \
	done

# Resolve constraints/ again, for every supported Python (needs each of them: pyenv's or on PATH).
constraints: $(STAMP)
	$(PY) scripts/pythons.py constraints

# torch (CPU, local file) and triton in .venv, plus one overlay per upstream version, and vLLM's own
# block-pool tests from each release's sdist on the package index (stamped: a second run fetches
# nothing; a failed fetch fails here in one line unless KVCACHED_UPSTREAM_OPTIONAL=1).
ADAPTER_ENVS := bash scripts/adapter-envs.sh --install-base --constraints $(CONSTRAINTS) --prune-native --check $(PY) $(ENVS)
adapter-envs: $(STAMP)
	$(ADAPTER_ENVS)

# what `make test` needs of them: torch and triton, and each serving runtime's newest overlay
# (a fresh machine builds two overlays, not seven; `make test-matrix` builds the rest)
adapter-envs-newest: $(STAMP)
	$(ADAPTER_ENVS) $$($(PY) scripts/support.py newest-serving)

# each runtime's newest overlay (adapters/support.py's last in its row): its adapter suite, and
# upstream's own tests with the patches off and on (scripts/upstream-tests.py)
test-adapters: adapter-envs-newest
	bash scripts/test-adapters.sh $(PY) $(ENVS) $$($(PY) scripts/support.py newest-overlays)

# every other overlay, the same way: the older releases, then kvcached mode inside each runtime
# (real servers starting up); .ci/run runs it after `make test`, so CI runs each overlay once
test-matrix: adapter-envs
	bash scripts/test-adapters.sh $(PY) $(ENVS) $$($(PY) scripts/support.py matrix-overlays)

# The newest SGLang, vLLM and kvcached on the package index, checked statically against every
# patch target (scripts/canary.py: downloaded into .canary/, parsed, never installed); a table of
# what still applies.  Exit 1 if a newest release lacks a target; CANARY_ARGS=--report never fails.
canary: $(STAMP)
	$(PY) scripts/canary.py $(CANARY_ARGS)

bench: $(BENCH_STAMP)
	$(BENCH_PY) -m pip install --quiet 'matplotlib>=3.7,<4'
	@$(MAKE) -s --no-print-directory $(SIM_STAMP) || echo "could not prepare the hand-over benchmark (see $(SIM_LOG))"
	mkdir -p bench-results
	$(BENCH_PY) benchmarks/suite.py --out bench-results

# Randomized worker and broker kills, stops, evictions and limit changes (about 6 minutes on
# 2 cores); prints the figures, writes bench-results/chaos.json, exits 1 on any mismatch.
chaos: $(BENCH_STAMP)
	mkdir -p bench-results
	$(BENCH_PY) benchmarks/chaos.py $(CHAOS_ARGS) --json bench-results/chaos.json

replay: $(STAMP)
	$(PY) -m pip install --quiet 'matplotlib>=3.7,<4'
	mkdir -p bench-results
	$(VENV)/bin/kvcached-broker replay --generate bench-results/trace.jsonl
	$(VENV)/bin/kvcached-broker replay bench-results/trace.jsonl --json bench-results/replay.json --plot bench-results/replay.png

# The GPU check (scripts/gpu-check; docs/performance.md, "The GPU check").  On a machine with a CUDA
# GPU, after `scripts/gpu-check --prepare` here and with .gpu-check/ carried there: `make gpu-check`
# (that machine's python3, which has torch).  `make gpu-check-simulate` runs the same parts on the
# simulated device, as CI does (kvcached's pools need torch and kvcached's Python code: $(SIM_STAMP)).
gpu-check:
	$(PYTHON) scripts/gpu-check $(GPU_CHECK_ARGS)

gpu-check-simulate: $(STAMP)
	@$(MAKE) -s --no-print-directory $(SIM_STAMP) || echo "could not prepare kvcached's pools: that part is skipped (see $(SIM_LOG))"
	$(PY) scripts/gpu-check --simulate --out bench-results/gpu-check $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(CVENV) .venv-py* $(ENVS) build *.egg-info .pytest_cache .hypothesis .gpu-check gpu-check-results .canary
