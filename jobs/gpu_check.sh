#!/usr/bin/env bash
# mpiattn GPU check: one machine, one GPU, under 5 minutes, nothing fetched from the network.
#
#   jobs/gpu_check.sh [OUTDIR]        on the GPU machine; results go to OUTDIR, else $OUT, else /tmp/mpiattn-gpu-check
#   jobs/gpu_check.sh --fetch-wheels  on a machine with network: download into .whl/ (git-ignored)
#                                     the wheels a GPU image may lack (mpich, mpi4py, pytest-mpi)
#   jobs/gpu_check.sh --dry-run [DIR] on a machine without a GPU: the same steps against the fake
#                                     CuPy of tests/fake_cupy.py, tiny benchmark sizes (checks the
#                                     script and the CuPy code paths, not the GPU; numbers mean
#                                     nothing; carried wheels are not installed)
#
# Sections, each with a time limit, in order of priority; a section that no longer fits in
# the total budget (GPU_CHECK_BUDGET_S, default 270 s) is skipped and reported as such:
#   1. preflight: GPU, CuPy, MPI, pytest-mpi; install carried wheels from .whl/ if present
#   2. tests/gpu/test_gpu.py on 1 rank (fused kernels vs generic code, transports, upload, binding)
#   3. the whole suite on CuPy arrays (MPIATTN_TEST_BACKEND=cupy), 1 rank
#   4. the whole suite on CuPy arrays, 2 ranks sharing the GPU, staged transport
#   5. comm + GPU tests at 2 ranks with MPIATTN_GPU_TRANSPORT=nccl (NCCL refuses two ranks
#      on one GPU: expect the collective fall-back to staged) and =cuda-aware when the MPI
#      library says it is CUDA-aware (skipped otherwise, with the evidence)
#   6. python -m mpiattn.bench.gpu: ring attention TFLOP/s vs cupy.matmul and torch -> gpu_bench.json
# Output: gpu_check.log (everything), summary.json (one line per section), gpu_bench.json.
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

BENCH_ARGS=()
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then
    shift
    DRY=1
    export PYTHONPATH=$REPO/tests/fake_site${PYTHONPATH:+:$PYTHONPATH}
    BENCH_ARGS=(--sizes "256,512" --dims 16 --block 64 --no-torch)
fi

OUTDIR=${1:-${OUT:-/tmp/mpiattn-gpu-check}}
mkdir -p "$OUTDIR"
LOG=$OUTDIR/gpu_check.log
SUMMARY=$OUTDIR/summary.json
BUDGET=${GPU_CHECK_BUDGET_S:-270}
START=$SECONDS
: >"$LOG"
echo "[" >"$SUMMARY"
FIRST=1

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
record preflight ok $((SECONDS - START)) 0

# -------------------------------------------------------------------- 2-5. tests
PYTEST=("$PY" -m pytest -q -p no:cacheprovider --timeout=150 -rfEs)
[[ -n $CHECK_WITH_MPI ]] && PYTEST+=("$CHECK_WITH_MPI")
section "test_gpu, 1 rank" 75 "${PYTEST[@]}" tests/gpu/test_gpu.py
if [[ -z $CHECK_WITH_MPI ]]; then
    say "skipping the whole-suite sections (no pytest-mpi)"
else
    section "CuPy suite, 1 rank" 80 "${PYTEST[@]}" --maxfail=20 tests
    # the attention tests again with the fused elementwise kernels switched in (opt-in until this passes)
    section "attention tests, fused kernels, 1 rank" 40 \
        env MPIATTN_FUSED_KERNELS=1 "${PYTEST[@]}" --maxfail=10 tests/attention/test_attention.py tests/layer/test_layer.py
    if [[ -n $CHECK_MPIEXEC ]]; then
        section "CuPy suite, 2 ranks, staged" 80 \
            env MPIATTN_GPU_TRANSPORT=staged "$0" --two-ranks --maxfail=20 tests
        section "comm+gpu tests, 2 ranks, nccl" 40 \
            env MPIATTN_GPU_TRANSPORT=nccl "$0" --two-ranks tests/core/test_comm.py tests/gpu/test_gpu.py
        AUTO=$(MPIATTN_GPU_TRANSPORT=auto "$PY" -c \
            "from mpiattn import gpu; print(*gpu.decide_transport(notify=False), sep=' | ')" 2>&1 | tail -n 1)
        say "auto transport decision: $AUTO"
        if [[ $AUTO == cuda-aware* ]]; then
            section "comm+gpu+attention tests, 2 ranks, cuda-aware" 60 env MPIATTN_GPU_TRANSPORT=cuda-aware \
                "$0" --two-ranks tests/core/test_comm.py tests/gpu/test_gpu.py tests/attention/test_attention.py
        else
            say "== cuda-aware: SKIPPED (this MPI is not CUDA-aware by its own account: $AUTO)"
            record "cuda-aware, 2 ranks" "skipped: not detected" 0 0
        fi
    fi
fi

# ---------------------------------------------------------------- 6. benchmark
BENCH_LIMIT=$(($(left) - 10))
((BENCH_LIMIT > 150)) && BENCH_LIMIT=150
section "benchmark (1 rank)" "$BENCH_LIMIT" \
    "$PY" -m mpiattn.bench.gpu --out "$OUTDIR" --budget-s $((BENCH_LIMIT - 15)) "${BENCH_ARGS[@]}"
finish 0
