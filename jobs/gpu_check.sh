#!/usr/bin/env bash
# mpiattn GPU check: one machine, one GPU, at most 9 minutes, nothing fetched from the network.
#
#   jobs/gpu_check.sh [OUTDIR]        on the GPU machine; results go to OUTDIR, else $OUT, else /tmp/mpiattn-gpu-check
#   jobs/gpu_check.sh --fetch-wheels  on a machine with network: download into .whl/ (git-ignored)
#                                     the wheels a GPU image may lack (mpich, mpi4py, pytest-mpi)
#   jobs/gpu_check.sh --dry-run [DIR] on a machine without a GPU: every section against the fake
#                                     CuPy of tests/fake_cupy.py at tiny sizes (checks the script and
#                                     the CuPy code paths, not the GPU; numbers mean nothing; the ring's
#                                     contract cases without FlashAttention's shape sweep). CI runs it.
#
# Sections, in order, each with a time limit; the total budget (GPU_CHECK_BUDGET_S, default 530 s)
# is at least the sum of the limits, so nothing is skipped unless a section overruns:
#   preflight (25 s)   versions; torch's op schemas; carried wheels installed from .whl/
#   test_gpu (60 s)    tests/gpu on 1 rank (fused kernels vs their twins, transports, streams, upload)
#   grid (110 s)       float16/32/64 x {none, causal, padding, window, documents} x {native,
#                      native+fused, torch}, forward and backward, against float64 (grid.json)
#   stream (25 s)      legacy-stream uploads and a long legacy-stream queue, attention inside
#                      `with gpu.compute_stream()`, .get() outside, 20 times (stream.json)
#   two ranks (90 s)   ranks sharing the GPU: tests/gpu and the ring contract cases, staged; the
#                      NCCL request (expect the agreed fall-back: one GPU); cuda-aware if the MPI says so
#   sanitizer (60 s)   compute-sanitizer memcheck and racecheck on a driver of the fused kernels
#   performance (130 s) N = 32k, H = 8, E = 128, float16/float32, tiles 512 and 4096: native, native+fused,
#                      torch engine, torch SDPA, the float16 GEMM ceiling (python -m mpiattn.bench.gpu)
#   host/device (30 s) host time vs device time of one forward call, fused off and on (hostdev.json);
#                      CuPy's and torch's pools around a torch-engine call (pools.json)
# NVRTC compiles land in OUTDIR/cupy-cache (CUPY_CACHE_DIR), so a second run starts warm.
# Output in OUTDIR: gpu_check.log (everything), summary.json (status and seconds per section),
# one JSON file per Python section, gpu_bench.jsonl.
set -uo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 2
PY=${PYTHON:-python3}
WHEELS="mpich==5.0.2 mpi4py==4.1.2 pytest-mpi==0.6"

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    exclude=$(git rev-parse --git-path info/exclude)
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
    mkdir -p .whl
    # shellcheck disable=SC2086 # WHEELS is a list of requirement specifiers
    exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl $WHEELS
fi

if [[ "${1:-}" == "--two-ranks" ]]; then  # internal: pytest on 2 ranks sharing the GPU
    shift
    logdir=/tmp/mpiattn-ranklogs
    rm -rf "$logdir"
    # shellcheck disable=SC2086 # CHECK_WITH_MPI is empty or one flag
    MPIATTN_TEST_RANKLOG_DIR=$logdir "$CHECK_MPIEXEC" -n 2 "$PY" tests/_rank_main.py -q -p no:cacheprovider \
        --timeout=150 -rfE $CHECK_WITH_MPI "$@"
    rc=$?
    if ((rc != 0)) && [[ -f $logdir/rank1.log ]]; then
        echo "--- rank 1 log (tail)"
        tail -n 60 "$logdir/rank1.log"
    fi
    exit $rc
fi

BENCH_ARGS=(--sizes 32768 --heads 8 --dims 128 --dtypes float16,float32 --repeat 2)
SMALL=()
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then
    shift
    DRY=1
    export PYTHONPATH=$REPO/tests/fake_site${PYTHONPATH:+:$PYTHONPATH}
    BENCH_ARGS=(--sizes 256 --heads 2 --dims 16 --dtypes float16 --repeat 1 --no-torch --gemm-size 128)
    SMALL=(--small)
fi

OUTDIR=${1:-${OUT:-/tmp/mpiattn-gpu-check}}
mkdir -p "$OUTDIR"
LOG=$OUTDIR/gpu_check.log
SUMMARY=$OUTDIR/summary.json
BUDGET=${GPU_CHECK_BUDGET_S:-530}
export CUPY_CACHE_DIR=$OUTDIR/cupy-cache CUDA_MODULE_LOADING=EAGER
mkdir -p "$CUPY_CACHE_DIR"
START=$SECONDS
: >"$LOG"
echo "[" >"$SUMMARY"
FIRST=1
FAILED=0

say() { echo "$*" | tee -a "$LOG"; }
left() { echo $((BUDGET - (SECONDS - START))); }
record() {  # name status seconds limit
    local sep=","
    [[ $FIRST == 1 ]] && sep="" && FIRST=0
    printf '%s {"section": "%s", "status": "%s", "seconds": %s, "limit": %s}\n' "$sep" "$1" "$2" "$3" "$4" >>"$SUMMARY"
}

# section NAME LIMIT_S COMMAND...: run with min(LIMIT, what is left - 5) seconds, or skip
section() {
    local name=$1 limit=$2
    shift 2
    local avail
    avail=$(($(left) - 5))
    ((avail < limit)) && limit=$avail
    if ((limit < 15)); then
        say "== $name: SKIPPED (budget: $(left) s left of $BUDGET s)"
        record "$name" "skipped: budget" 0 0
        return 0
    fi
    say "== $name: start (limit ${limit} s, $(left) s of the budget left)"
    local t0=$SECONDS rc
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    local st="ok"
    ((rc == 124 || rc == 137)) && st="timeout"
    ((rc != 0 && rc != 124 && rc != 137)) && st="failed (exit $rc)"
    [[ $st != ok ]] && FAILED=1
    say "== $name: $st in $((SECONDS - t0)) s"
    record "$name" "$st" $((SECONDS - t0)) "$limit"
    return 0
}

finish() {
    echo "]" >>"$SUMMARY"
    say "== total $((SECONDS - START)) s (budget $BUDGET s); summary in $SUMMARY"
    exit "${1:-0}"
}

# ------------------------------------------------------------------ 1. preflight
say "== preflight $(date -u +%FT%TZ) in $REPO"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
if ((DRY == 0)) && compgen -G ".whl/*.whl" >/dev/null; then
    DEPS=/tmp/mpiattn-deps
    say "installing carried wheels from .whl/ into $DEPS (no network): $(cd .whl && echo *.whl)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --prefix "$DEPS" .whl/*.whl 2>&1 | tee -a "$LOG"
    SITE=$("$PY" -c "import sysconfig as s; v={'base': '$DEPS', 'platbase': '$DEPS'}; print(s.get_path('purelib', vars=v) + ':' + s.get_path('platlib', vars=v))")
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    export PATH=$DEPS/bin:$PATH
    [[ -e $DEPS/lib/libmpi.so.12 ]] && export MPI4PY_LIBMPI=$DEPS/lib/libmpi.so.12
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}  # mpiattn from this checkout
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MPIR_CVAR_ENABLE_HEAVY_YIELD=1
export MPIATTN_TEST_BACKEND=cupy

if ! "$PY" - 2>&1 <<'EOF' | tee -a "$LOG"; then
import sys
import cupy
from mpi4py import MPI
print("python", sys.version.split()[0], "| cupy", cupy.__version__, "| CUDA runtime",
      cupy.cuda.runtime.runtimeGetVersion(), "| GPUs", cupy.cuda.runtime.getDeviceCount())
print("MPI:", MPI.Get_library_version().splitlines()[0].strip(), "| mpi4py", __import__("mpi4py").__version__)
from cupy.cuda import nccl
print("NCCL:", nccl.get_version() if nccl.available else "not loadable")
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.cuda.is_available())
except Exception as exc:
    print("torch: not importable:", exc)
EOF
    say "preflight failed: CuPy with a GPU and mpi4py with an MPI library are both needed."
    say "If MPI is what is missing, run 'jobs/gpu_check.sh --fetch-wheels' where pip has network and carry .whl"
    record preflight failed $((SECONDS - START)) 0
    finish 2
fi
export CHECK_WITH_MPI="--with-mpi"
if ! "$PY" -c "import pytest_mpi" 2>/dev/null; then
    say "pytest-mpi is missing (carry it with --fetch-wheels): only tests/gpu/test_gpu.py can run"
    CHECK_WITH_MPI=""
fi
CHECK_MPIEXEC=$(command -v mpiexec || true)
export CHECK_MPIEXEC PY
[[ -z $CHECK_MPIEXEC ]] && say "no mpiexec on PATH: 2-rank sections will be skipped"
"$PY" jobs/gpu_check.py preflight 2>&1 | tee -a "$LOG" | tail -n 1 >"$OUTDIR/preflight.json"
record preflight ok $((SECONDS - START)) 0

# -------------------------------------------------------------------- the sections
PYTEST=("$PY" -m pytest -q -p no:cacheprovider --timeout=120 -rfEs)
[[ -n $CHECK_WITH_MPI ]] && PYTEST+=("$CHECK_WITH_MPI")
json_section() {  # json_section NAME LIMIT ARGS...: a Python section whose last line is its JSON
    local name=$1 limit=$2
    shift 2
    section "$name" "$limit" bash -c '"$@" | tee /tmp/mpiattn-section.out; rc=${PIPESTATUS[0]}; tail -n 1 /tmp/mpiattn-section.out >"'"$OUTDIR/$name.json"'"; exit $rc' _ "$@"
}
section "test_gpu" 60 "${PYTEST[@]}" tests/gpu
json_section grid 110 "$PY" jobs/gpu_check.py grid "${SMALL[@]}"
json_section stream 25 "$PY" jobs/gpu_check.py stream "${SMALL[@]}"
if [[ -n $CHECK_MPIEXEC && -n $CHECK_WITH_MPI ]]; then
    # the ring's contract cases; in a dry run without FlashAttention's shape sweep (the flash-* cases
    # but those with a softcap, sinks or a score_mod: sizes, not CuPy paths; the fake CuPy's arrays are
    # NumPy's, whose arithmetic the main suite checks on them): 27 -> 12 s on 2 cores
    RING_K="ring and not torch"
    ((DRY == 1)) && RING_K+=" and not (flash- and not sinks and not score_mod)"
    section "two ranks, staged" 50 env MPIATTN_GPU_TRANSPORT=staged "$0" --two-ranks tests/gpu \
        tests/attention/test_contract.py -k "$RING_K"
    section "two ranks, nccl requested (one GPU: agreed fall-back)" 20 env MPIATTN_GPU_TRANSPORT=nccl \
        "$0" --two-ranks tests/gpu -k "transport or ring"
    AUTO=$(MPIATTN_GPU_TRANSPORT=auto "$PY" -c \
        "from mpiattn import gpu; print(*gpu.decide_transport(notify=False), sep=' | ')" 2>&1 | tail -n 1)
    say "auto transport decision: $AUTO"
    if [[ $AUTO == cuda-aware* ]]; then
        section "two ranks, cuda-aware" 20 env MPIATTN_GPU_TRANSPORT=cuda-aware "$0" --two-ranks tests/gpu
    else
        say "== cuda-aware: SKIPPED (this MPI is not CUDA-aware by its own account: $AUTO)"
        record "two ranks, cuda-aware" "skipped: not detected" 0 0
    fi
else
    say "== two ranks: SKIPPED (no mpiexec or no pytest-mpi)"
    record "two ranks" "skipped: no mpiexec/pytest-mpi" 0 0
fi
if ((DRY == 0)) && command -v compute-sanitizer >/dev/null; then
    section "sanitizer memcheck" 30 compute-sanitizer --tool memcheck --error-exitcode 3 "$PY" jobs/gpu_check.py kernels
    section "sanitizer racecheck" 30 compute-sanitizer --tool racecheck --error-exitcode 3 "$PY" jobs/gpu_check.py kernels
else
    json_section kernels 30 "$PY" jobs/gpu_check.py kernels  # (no compute-sanitizer here)
fi
for tile in 512 4096; do
    ((DRY == 1)) && tile=$((tile / 32))
    section "performance, tile $tile, generic" 35 "$PY" -m mpiattn.bench.gpu \
        --out "$OUTDIR" --budget-s 28 --block "$tile" --engines native,torch "${BENCH_ARGS[@]}"
    section "performance, tile $tile, fused" 30 "$PY" -m mpiattn.bench.gpu \
        --out "$OUTDIR" --budget-s 24 --block "$tile" --engines fused --no-torch "${BENCH_ARGS[@]}"
done
json_section hostdev 15 "$PY" jobs/gpu_check.py hostdev "${SMALL[@]}"
json_section pools 15 "$PY" jobs/gpu_check.py pools "${SMALL[@]}"
finish "$FAILED"
