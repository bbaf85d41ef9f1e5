#!/usr/bin/env bash
# CI lane "torch_versions": the torch engine, mpiattn.torch and the transformers adapter on the
# oldest and the newest torch the `torch` extra admits (pyproject.toml: torch>=2.11,<2.16), each
# in a venv of its own (.ci/.venv-torch-<version>, pip's MPICH), the oldest torch beside the
# oldest transformers the `hf` extra admits (transformers>=5.23), the newest beside the newest.
# The main suite runs on the torch the CI pins for it (.ci/main-constraints.txt); here:
#   * the op schemas the torch engine was written for (mpiattn.kernels.torch_ops.available);
#   * at 1 and 2 ranks: tests/torch_interface (autograd, modules, the hf adapter on tiny Llama,
#     Qwen 3, Mistral, Gemma 2 and gpt-oss), tests/attention/test_engines.py, and the torch
#     engine's cases of the shared contract suite and of the score modifiers' grid.
# PyPI's Linux wheels of torch are CUDA builds (about 5 GB with their nvidia-* wheels); they run
# on a machine without a GPU. A machine-wide pip constraint (e.g. one capping torch below the
# newest release) is lifted for these venvs only (PIP_CONSTRAINT=/dev/null). --no-compile: the
# modules the tests import are compiled as they are imported (about 25 s less on 2 cores). The
# next release's wheels are downloaded (pip download, in the background) while the tests of the
# one before run, and installed from those files: the download, most of an install's 100 s
# with no pip cache, overlaps the tests (if it fails, the install downloads them itself). The
# oldest release's wheels likewise: .ci/run starts `torch_versions.sh --prefetch DIR` in the
# background once the main suite has ended (the other lanes run meanwhile) and points
# MPIATTN_CI_TORCH_WHEELS at DIR; the lane waits for that download (DIR/wheels-VERSION.rc: its
# exit status) and installs from it (alone, the lane downloads that release itself).
# Last line: "LANE torch_versions: PASS", "... FAIL (why)" or "... SKIP (why)" (SKIP: pip could
# not download a torch release).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
VERSIONS=(2.11.0 2.15.0)   # the extra's oldest and newest release

fetch() {  # fetch VERSION DIR: torch VERSION's wheels and their dependencies into DIR/wheels-VERSION
    PIP_CONSTRAINT=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 python3 -m pip download -q \
        -d "$2/wheels-$1" "torch==$1" >"$2/fetch-$1.log" 2>&1
}
if [[ ${1:-} == --prefetch ]]; then  # --prefetch DIR: the oldest release's wheels, for .ci/run
    mkdir -p "$2" || exit 1
    fetch "${VERSIONS[0]}" "$2"
    rc=$?
    echo "$rc" >"$2/wheels-${VERSIONS[0]}.rc"
    exit "$rc"
fi

# shellcheck source=.ci/lanes/lib.sh
. .ci/lanes/lib.sh
lane_init torch_versions
declare -A TRANSFORMERS=([2.11.0]="transformers==5.23.0" [2.15.0]="transformers>=5.23,<6")
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 PY_COLORS=0
TESTS=(tests/torch_interface tests/attention/test_engines.py tests/attention/test_contract.py
       tests/attention/test_modifiers.py)
# every test of the torch-interface and engine files; of the two suites, the torch engine's cases
# (not inductor's code generation: a cold compile is 35-70 s a version on 2 cores; the main
# suite runs it on CI's pinned torch, and torch's opcheck of every operator runs here)
SELECT="((not test_contract and not test_modifiers) or torch) and not inductor"

FETCH_PID=""
lane_cleanup() {  # a download still running when the lane ends (a FAIL): stop it
    if [[ -n $FETCH_PID ]]; then
        pkill -P "$FETCH_PID" 2>/dev/null
        kill "$FETCH_PID" 2>/dev/null
        wait "$FETCH_PID" 2>/dev/null
    fi
    return 0
}
for i in "${!VERSIONS[@]}"; do
    version=${VERSIONS[$i]}
    venv=$PWD/.ci/.venv-torch-$version
    py=$venv/bin/python
    step "venv $venv: torch $version, mpiattn[mpich,test,hf]"
    python3 -m venv "$venv" || verdict FAIL "python3 -m venv failed"
    fetched=0 waited=""  # waited: where this release's wheels were being downloaded meanwhile
    wheels=$LANE_TMP
    pre=${MPIATTN_CI_TORCH_WHEELS:-}
    if ((i == 0)) && [[ -n $pre && -d $pre ]]; then  # by .ci/run, while the lanes before ran
        waited=".ci/run during the lanes before"
        for _ in $(seq 300); do [[ -s $pre/wheels-$version.rc ]] && break; sleep 1; done
        [[ $(cat "$pre/wheels-$version.rc" 2>/dev/null) == 0 ]] && fetched=1
        wheels=$pre
    elif [[ -n $FETCH_PID ]]; then  # by this lane, during the tests before
        waited="this lane during the tests before"
        wait "$FETCH_PID" && fetched=1
        FETCH_PID=""
    fi
    ((fetched)) && { PIP_CONSTRAINT=/dev/null "$py" -m pip install -q --no-compile --no-index \
        --find-links "$wheels/wheels-$version" "torch==$version" || fetched=0; }
    if [[ -n $waited ]]; then
        ((fetched)) && echo "torch $version installed from the wheels downloaded by $waited" \
            || echo "the download of torch $version by $waited failed or is not done: pip downloads it now"
    fi
    rm -rf "$wheels/wheels-$version"  # (about 5 GB)
    if ((!fetched)); then
        PIP_CONSTRAINT=/dev/null "$py" -m pip install -q --no-compile "torch==$version" \
            || verdict SKIP "pip could not install torch $version"
    fi
    next=${VERSIONS[$((i + 1))]:-}
    if [[ -n $next ]]; then
        fetch "$next" "$LANE_TMP" &
        FETCH_PID=$!
    fi
    PIP_CONSTRAINT=/dev/null "$py" -m pip install -q --no-compile -e ".[mpich,test,hf]" "torch==$version" \
        "${TRANSFORMERS[$version]}" \
        || verdict FAIL "pip install -e .[mpich,test,hf] with torch $version failed"
    got=$("$py" -c "import torch; print(torch.__version__)") || verdict FAIL "torch $version does not import"
    [[ $got == "$version"* ]] || verdict FAIL "torch $version asked for, $got installed"
    hf=$("$py" -c "import transformers; print(transformers.__version__)") \
        || verdict FAIL "transformers does not import beside torch $got"
    echo "torch $got with transformers $hf"
    why=$("$py" -c "from mpiattn.kernels import torch_ops; print(torch_ops.available() or 'ok')")
    echo "torch $got: the engine's op schemas: $why"
    [[ $why == ok ]] || verdict FAIL "torch $got: $why"
    for n in 1 2; do
        step "torch $got at $n rank(s)"
        log=$LANE_TMP/torch-$version-$n.log
        launch=("$venv/bin/mpiexec" -n "$n")
        [[ $n == 1 ]] && launch=()  # one process without mpiexec: its tests start MPI jobs of their own
        timeout -k 10 600 "${launch[@]}" "$py" -m pytest --with-mpi -q -p no:cacheprovider \
            -rfE "${TESTS[@]}" -k "$SELECT" | tee "$log"
        rc=${PIPESTATUS[0]}
        [[ $rc == 0 ]] || verdict FAIL "torch $got at $n rank(s): pytest exited $rc"
    done
done
sum_summaries "$LANE_TMP"/torch-*.log
verdict PASS
