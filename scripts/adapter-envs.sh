#!/usr/bin/env bash
# adapter-envs.sh -- build per-version "overlay" directories of real upstream
# serving engines (SGLang, vLLM) for CPU-only adapter tests.
#
# One base venv holds torch (CPU build) and triton; everything else is installed
# with `pip install --no-deps --target DIR` from the pinned lists below and is
# selected at run time with PYTHONPATH:
#
#   sglang-X : PYTHONPATH=OUT/sglang-X:OUT/common:tests/stubs   (torchvision import stub)
#   vllm-X   : PYTHONPATH=OUT/vllm-X:OUT/common           (plus VLLM_TARGET_DEVICE=cpu)
#
# OUT/<name>.env holds those exports; source it, then run the base python.
#
# usage: adapter-envs.sh [options] BASE_PYTHON OUT_DIR [OVERLAY...]
#   OVERLAY       an overlay of the table of supported releases (adapters/support.py, read
#                 through scripts/support.py), e.g. vllm-0.34.0 (default: all of them; `common` is
#                 always built); each has its pins below
#   --install-base  pip-install the pinned torch/triton into BASE_PYTHON if missing
#   --constraints FILE  install them with pip's -c FILE (constraints/test.txt: their
#                 dependencies pinned too)
#   --prune-native  delete vllm's compiled CUDA extension modules (*.so) after
#                 install; none of them loads on a CPU-only host (saves ~1.7 GB)
#   --force       rebuild overlays even if their pin list is unchanged
#   --check       after building, import the key modules of each overlay (once per overlay
#                 and base: stamped in OVERLAY/.checked)
#
# Nothing here copies upstream source: overlays are plain pip --target installs
# of exact pins (wheels only). The torchvision import stub is our own code, in
# tests/stubs; this script writes only the *.env, SUMMARY.tsv and MANIFEST files.
# It also fetches (scripts/upstream-tests.py fetch, stamped) the vLLM overlays' own
# upstream tests into OUT/upstream/ (never committed); KVCACHED_UPSTREAM_OPTIONAL=1
# lets the build go on when the package index cannot serve them.
set -euo pipefail

TORCH_PIN="torch==2.13.0"     # must resolve to the local CPU wheel; never unpinned
TRITON_PIN="triton==3.9.0"    # sglang imports triton at module level (kernels never launch)

# ---------------------------------------------------------------- pin lists
# Shared by every overlay (identical versions in all four resolutions).
PINS_common="
aiohappyeyeballs==2.7.1
aiohttp==3.14.5
aiosignal==1.4.0
annotated-types==0.8.0
anyio==4.16.0
attrs==26.1.0
certifi==2026.10.19.post1
einops==0.8.2
frozenlist==1.8.0
h11==0.16.0
idna==3.20
msgspec==0.23.0
multidict==7.2.1
numpy==2.4.6
packaging==26.4
pillow==13.0.0
propcache==0.5.4
psutil==7.2.2
pybase64==1.5.1
pydantic==2.14.4
pydantic-core==2.50.5
PyYAML==6.0.4
pyzmq==27.3.0
regex==2026.11.19
requests==2.34.2
safetensors==0.8.0
sniffio==1.3.1
tqdm==4.70.1
typing-inspection==0.4.5
urllib3==2.8.0
yarl==1.25.1
"

# sglang 0.5.13.post1 pins transformers==5.8.1 and openai==2.6.1 itself;
# transformers 5.8.1 needs tokenizers<=0.23.0 and huggingface-hub<2.
# sglang 0.5.12: the last release with the single-module allocator (mem_cache/allocator.py)
# and the first with DeepSeek-V4 pools; it resolves to the same pins as 0.5.13.post1.
PINS_sglang_0_5_12="
sglang==0.5.12
compressed-tensors==0.20.1
dill==0.4.1
distro==1.9.0
gguf==0.19.0
httpcore==1.0.9
httpx==0.29.0
huggingface-hub==1.33.0
ipython==9.18.1
loguru==0.7.3
openai==2.6.1
orjson==3.13.0
partial-json-parser==0.2.1.1.post7
Pygments==2.21.0
sentencepiece==0.2.3
starlette==1.10.0
tokenizers==0.22.2
traitlets==5.16.1
transformers==5.8.1
"

PINS_sglang_0_5_13_post1="
sglang==0.5.13.post1
compressed-tensors==0.20.1
dill==0.4.1
distro==1.9.0
gguf==0.19.0
httpcore==1.0.9
httpx==0.29.0
huggingface-hub==1.33.0
ipython==9.18.1
loguru==0.7.3
openai==2.6.1
orjson==3.13.0
partial-json-parser==0.2.1.1.post7
Pygments==2.21.0
sentencepiece==0.2.3
starlette==1.10.0
tokenizers==0.22.2
traitlets==5.16.1
transformers==5.8.1
"

# sglang 0.5.23 pins transformers==5.19.0, tokenizers==0.23.2,
# compressed-tensors==0.18.0, sentencepiece==0.2.1, openai==2.8.0,
# apache-tvm-ffi==0.1.11; tokenizers 0.23.2 needs huggingface-hub<2.
# fastapi<0.137 (newer ones import opentelemetry at module level).
PINS_sglang_0_5_23="
sglang==0.5.23
annotated-doc==0.0.7
apache-tvm-ffi==0.1.11
click==8.5.1
compressed-tensors==0.18.0
dill==0.4.1
distro==1.9.0
fastapi==0.136.3
gguf==0.19.0
httpcore==1.0.9
httpx==0.29.0
huggingface-hub==1.33.0
ipython==9.18.1
loguru==0.7.3
openai==2.8.0
orjson==3.13.0
partial-json-parser==0.2.1.1.post7
Pygments==2.21.0
sentencepiece==0.2.1
starlette==1.10.0
tokenizers==0.23.2
traitlets==5.16.1
transformers==5.19.0
uvicorn==0.55.0
"

# Last vLLM release before the DeepSeek-V4 KV-spec fields (model_version /
# compress_ratio arrived in 0.20.0, tokens_per_state in 0.29.0, cache_role in 0.30.0).
PINS_vllm_0_19_1="
vllm==0.19.1
apache-tvm-ffi==0.1.11
cachetools==8.0.2
cbor2==6.3.0
cloudpickle==3.1.3
diskcache==5.6.3
gguf==0.19.0
httpcore2==2.16.2
httpx2==2.16.2
huggingface-hub==2.4.0
llguidance==1.3.0
openai==3.57.0
openai-harmony==0.0.8
prometheus-client==0.26.0
py-cpuinfo==9.0.0
tokenizers==0.23.3
transformers==5.20.2
truststore==0.10.5
uvloop==0.23.0
xgrammar==0.2.9
"

# What vLLM 0.30.0 to 0.34.0 resolve to beside vllm itself (one closure: see each release below).
VLLM_0_33_DEPS="
annotated-doc==0.0.7
apache-tvm-ffi==0.1.11
cachetools==8.0.2
cbor2==6.3.0
cloudpickle==3.1.3
fastapi==0.136.3
httpcore2==2.16.2
httpx2==2.16.2
huggingface-hub==2.4.0
llguidance==1.7.3
openai==3.57.0
openai-harmony==0.0.8
partial-json-parser==0.2.1.1.post7
prometheus-client==0.26.0
py-cpuinfo==9.0.0
starlette==1.10.0
tokenizers==0.23.3
transformers==5.20.2
truststore==0.10.5
uvloop==0.23.0
xgrammar==0.2.8
"

# vllm 0.30.0 (HiSparse binds allocate_kv_cache; kvcached 0.1.6's newest vLLM, Model Runner V2)
# pins torch==2.13.0 (the base's) and asks xgrammar<1, transformers>=5.10.4, tokenizers>=0.21.1,
# openai-harmony>=0.0.3; it resolves to the 0.33.0 pins below.
PINS_vllm_0_30_0="
vllm==0.30.0
$VLLM_0_33_DEPS"

# vllm 0.33.0 pins xgrammar==0.2.8, llguidance<1.8, transformers<5.21,
# fastapi<0.137, apache-tvm-ffi==0.1.11.
PINS_vllm_0_33_0="
vllm==0.33.0
$VLLM_0_33_DEPS"

# vllm 0.34.0 asks transformers<5.23, huggingface_hub>=2, tokenizers>=0.23.3 (and torch==2.14.0,
# which --no-deps leaves to the base's 2.13.0): the 0.33.0 pins satisfy them.
PINS_vllm_0_34_0="
vllm==0.34.0
$VLLM_0_33_DEPS"

SUPPORT="$(dirname "$0")/support.py"  # the table of supported releases (adapters/support.py)

# ---------------------------------------------------------------- helpers
die() { echo "adapter-envs: $*" >&2; exit 1; }
log() { echo "[adapter-envs] $*" >&2; }
STUBS="$(cd "$(dirname "$0")/.." && pwd)/tests/stubs"
now() { date +%s.%N; }
pins_var() { local v="PINS_${1//[.-]/_}"; printf '%s' "${!v}"; }
pins_of() { pins_var "$1" | sed '/^[[:space:]]*$/d'; }
size_of() { du -sb "$1" | cut -f1; }
human() { numfmt --to=iec --suffix=B "$1" 2>/dev/null || echo "${1}B"; }

INSTALL_BASE=0 PRUNE=0 FORCE=0 CHECK=0 BASE_CONSTRAINTS=()
while [ $# -gt 0 ]; do
  case $1 in
    --install-base) INSTALL_BASE=1 ;;
    --constraints) [ $# -ge 2 ] && [ -f "$2" ] || die "--constraints needs a file"
                   BASE_CONSTRAINTS=(-c "$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"); shift ;;
    --prune-native) PRUNE=1 ;;
    --force) FORCE=1 ;;
    --check) CHECK=1 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    --) shift; break ;;
    -*) die "unknown option $1" ;;
    *) break ;;
  esac
  shift
done
[ $# -ge 2 ] || die "usage: adapter-envs.sh [options] BASE_PYTHON OUT_DIR [OVERLAY...]"
PY=$1 OUT=$2; shift 2
ALL_OVERLAYS=$("$PY" "$SUPPORT" overlays) || die "cannot read the table of supported releases ($SUPPORT)"
WANT=${*:-$ALL_OVERLAYS}
for o in $WANT; do
  case " $ALL_OVERLAYS " in *" $o "*) ;; *) die "unknown overlay '$o' (choose from: $ALL_OVERLAYS)";; esac
done
[ -x "$PY" ] || die "base python '$PY' is not executable"
case $PY in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; *) PY=$(command -v "$PY") ;; esac
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

PIP=("$PY" -m pip --disable-pip-version-check --no-input)

# ---------------------------------------------------------------- base venv
base_has() {  # base_has MODULE VERSION-PREFIX
  "$PY" - "$1" "$2" <<'EOF' 2>/dev/null
import importlib.metadata as md, sys
try:
    v = md.version(sys.argv[1])
except md.PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if v == sys.argv[2] or v.startswith(sys.argv[2] + "+") else 1)
EOF
}
need_triton=0
case " $WANT " in *" sglang-"*) need_triton=1 ;; esac
if ! base_has torch "${TORCH_PIN#*==}"; then
  [ $INSTALL_BASE = 1 ] || die "base python lacks $TORCH_PIN (rerun with --install-base, or: $PY -m pip install $TORCH_PIN)"
  log "installing $TORCH_PIN into base"; "${PIP[@]}" install -q "${BASE_CONSTRAINTS[@]}" "$TORCH_PIN"
fi
if [ $need_triton = 1 ] && ! base_has triton "${TRITON_PIN#*==}"; then
  [ $INSTALL_BASE = 1 ] || die "base python lacks $TRITON_PIN (needed by sglang; rerun with --install-base)"
  log "installing $TRITON_PIN into base"; "${PIP[@]}" install -q "${BASE_CONSTRAINTS[@]}" "$TRITON_PIN"
fi
"$PY" -W ignore -c 'import torch; assert not torch.version.cuda, "base torch must be the CPU build"' \
  || die "base torch is not a CPU build"

# ---------------------------------------------------------------- overlays
SUMMARY="$OUT/SUMMARY.tsv"
[ -f "$SUMMARY" ] || printf 'overlay\tbytes\tinstall_seconds\tpins\n' > "$SUMMARY"

build_overlay() {  # build_overlay NAME
  local name=$1 dir="$OUT/$1" req stamp t0 t1 secs bytes prune_here=0
  case $name in vllm-*) prune_here=$PRUNE ;; esac
  req=$(pins_of "$name")
  [ -n "$req" ] || die "$name: no pins (add PINS_${name//[.-]/_} to $0)"
  stamp=$(printf '%s\nprune=%s\n' "$req" "$prune_here" | sha256sum | cut -d' ' -f1)
  if [ $FORCE = 0 ] && [ -f "$dir/.complete" ] && [ "$(cat "$dir/.complete")" = "$stamp" ]; then
    log "$name: up to date"; return
  fi
  log "$name: installing $(printf '%s\n' "$req" | wc -l) pinned distributions"
  rm -rf "$dir"; mkdir -p "$dir"
  printf '%s\n' "$req" > "$dir/.requirements.txt"
  t0=$(now)
  "${PIP[@]}" install -q --no-deps --only-binary=:all: --target "$dir" -r "$dir/.requirements.txt" \
    2>&1 | grep -v -E "^WARNING: (Location|Target directory)" >&2 || true
  # pip's exit status is swallowed by the filter above; verify every pin landed.
  "$PY" - "$dir" "$dir/.requirements.txt" <<'EOF' || die "$name: install incomplete"
import importlib.metadata as md, re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
have = {norm(d.metadata["Name"]): d.version for d in md.distributions(path=[sys.argv[1]])}
bad = []
for line in open(sys.argv[2]):
    name, ver = line.strip().split("==")
    if have.get(norm(name)) != ver:
        bad.append(f"{name}=={ver} (got {have.get(norm(name))})")
if bad:
    print("missing/mismatched:", *bad, sep="\n  ", file=sys.stderr)
    sys.exit(1)
EOF
  if [ "$prune_here" = 1 ]; then
    find "$dir/vllm" -name '*.so' -type f -delete
  fi
  t1=$(now)
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')
  bytes=$(size_of "$dir")
  printf '%s\t%s\t%s\t%s\n' "$name" "$bytes" "$secs" "$(printf '%s\n' "$req" | wc -l)" >> "$SUMMARY"
  echo "$stamp" > "$dir/.complete"
  log "$name: $(human "$bytes") in ${secs}s"
}

write_env() {  # write_env NAME
  local name=$1 pp
  case $name in
    sglang-*) pp="$OUT/$name:$OUT/common:$STUBS"
      printf '%s\n' "# source me; then run $PY" "export PYTHONPATH=\"$pp\"" \
        "# 0.5.13.post1 only: alloc_extend/alloc_decode launch Triton; set TRITON_INTERPRET=1" \
        "# before importing sglang to run the real kernels on CPU." > "$OUT/$name.env" ;;
    vllm-*) pp="$OUT/$name:$OUT/common"
      printf '%s\n' "# source me; then run $PY" "export PYTHONPATH=\"$pp\"" \
        "export VLLM_TARGET_DEVICE=cpu" > "$OUT/$name.env" ;;
  esac
}

check_overlay() {  # check_overlay NAME
  local name=$1 mods
  mods=$("$PY" "$SUPPORT" check-modules "$name") || die "$name: no modules to check"
  ( set -a; . "$OUT/$name.env"; set +a
    "$PY" -W ignore - $mods <<'EOF'
import importlib, sys, time
t = time.time()
for m in sys.argv[1:]:
    importlib.import_module(m)
print(f"  imports OK ({len(sys.argv) - 1} modules, {time.time() - t:.1f}s)")
EOF
  ) 2>&1 | grep -E "imports OK|Error|error:" >&2 || die "$name: import check failed"
}

build_overlay common
# kvcached 0.1.6's Python package (sdist, sha256-pinned, no CUDA build) for tests/adapters/kvcached
"$PY" "$(dirname "$0")/fetch-kvcached.py" "$OUT" || die "kvcached-0.1.6: fetch failed"
for o in $WANT; do
  build_overlay "$o"
  write_env "$o"
done
# upstream's own allocator and block-pool tests (tests/adapters/upstream/MANIFEST.tsv): vLLM's, from
# each release's sdist on the package index (sha256-pinned, stamped); a failure is one line and
# fails the build, unless KVCACHED_UPSTREAM_OPTIONAL=1.  SGLang's come only from GitHub
# (scripts/upstream-tests.py fetch-github, by hand).
"$PY" "$(dirname "$0")/upstream-tests.py" fetch "$OUT" $WANT || exit 1
{
  echo "base_python=$PY"
  "$PY" -W ignore -c 'import sys, torch; print("python=" + sys.version.split()[0]); print("torch=" + torch.__version__)'
  "$PY" -c 'import triton; print("triton=" + triton.__version__)' 2>/dev/null || echo "triton=absent"
  echo "pip=$("$PY" -m pip --version | cut -d' ' -f2)"
  echo "prune_native=$PRUNE"
} > "$OUT/MANIFEST"
if [ $CHECK = 1 ]; then
  # stamped: an overlay whose pins and base (MANIFEST: python, torch, triton, pip) are unchanged
  # since its last check imports the same way (about 80 s for all of them, saved on every run)
  for o in $WANT; do
    checked=$( { cat "$OUT/$o/.complete" "$OUT/MANIFEST"; } 2>/dev/null | sha256sum | cut -d' ' -f1)
    if [ $FORCE = 0 ] && [ -f "$OUT/$o/.checked" ] && [ "$(cat "$OUT/$o/.checked")" = "$checked" ]; then
      log "$o: imports checked before"; continue
    fi
    log "$o: checking imports"; check_overlay "$o"
    echo "$checked" > "$OUT/$o/.checked"
  done
fi
log "done: $OUT ($(human "$(size_of "$OUT")") total)"
