#!/usr/bin/env bash
# Run the adapter tests once per upstream version, each against the real upstream classes
# installed in its overlay (see scripts/adapter-envs.sh); then upstream's own allocator and
# block-pool tests with the patches off and on (scripts/upstream-tests.py; fetched files only);
# kvcached-0.1.6 runs kvcached mode's tests against kvcached's real Python code; a combined overlay
# kvcached+RUNTIME-VERSION (e.g. kvcached+sglang-0.5.23) runs those of kvcached mode inside the
# runtime's real classes, with both on one path.  A run collects the test modules whose
# pytest.mark.runtime names the overlay's runtimes, wherever they live (tests/overlay_selection.py).
# Which overlays run, and which tests each runs, is the table of supported releases
# (adapters/support.py, read through scripts/support.py): by default every overlay it lists.
# TEST_JOBS: pytest-xdist's workers per suite (a number, or auto: one per core); unset, one process.
#   usage: test-adapters.sh PYTHON ENVS_DIR [OVERLAY...]
set -euo pipefail
PY=$1 ENVS=$2; shift 2
cd "$(dirname "$0")/.."
SUPPORT=scripts/support.py
OVERLAYS=${*:-$("$PY" "$SUPPORT" test-overlays)}
KVCACHED=$("$PY" "$SUPPORT" kvcached-overlay)
JOBS=${TEST_JOBS:-0}
status=0
for overlay in $OVERLAYS; do
  if [ "${overlay%%+*}" = kvcached ] && [ "$overlay" != "${overlay#*+}" ]; then
    # kvcached mode in a runtime: the runtime's overlay, then kvcached's Python code, on one path
    inner=${overlay#*+}
    suite=$("$PY" "$SUPPORT" suite "$overlay") || { status=1; continue; }
    echo "=== kvcached mode tests: $overlay${suite:+ ($suite)} ==="
    (
      set -a; . "$ENVS/$inner.env"; runtime_path=$PYTHONPATH; . "$ENVS/$KVCACHED.env"; set +a
      export PYTHONPATH="$runtime_path:$PYTHONPATH"
      export KVCACHED_BROKER_TEST_RUNTIME="$inner" KVCACHED_BROKER_TEST_KVCACHED="$KVCACHED"
      # shellcheck disable=SC2086  # the suite is a list of paths
      "$PY" -m pytest -q -n "$JOBS" -p no:cacheprovider ${suite:-tests}
    ) || status=1
    continue
  fi
  runtime=${overlay%%-*}
  if [ "$runtime" = kvcached ]; then
    # kvcached mode: kvcached's real Python code (scripts/fetch-kvcached.py), its native extension
    # replaced by a test double, real brokers and processes (the tests marked runtime("kvcached"))
    echo "=== kvcached tests: $overlay ==="
    (
      set -a; . "$ENVS/$overlay.env"; set +a
      export KVCACHED_BROKER_TEST_RUNTIME="$overlay"
      "$PY" -m pytest -q -n "$JOBS" -p no:cacheprovider tests
    ) || status=1
    continue
  fi
  suite=$("$PY" "$SUPPORT" suite "$overlay") || { status=1; continue; }
  echo "=== adapter tests: $overlay${suite:+ ($suite)} ==="
  (
    set -a; . "$ENVS/$overlay.env"; set +a
    export KVCACHED_BROKER_TEST_RUNTIME="$overlay"
    # shellcheck disable=SC2086  # the suite is a list of paths
    "$PY" -m pytest -q -n "$JOBS" -p no:cacheprovider ${suite:-tests}
  ) || status=1
  "$PY" scripts/upstream-tests.py run "$PY" "$ENVS" "$overlay" || status=1
done
exit $status
