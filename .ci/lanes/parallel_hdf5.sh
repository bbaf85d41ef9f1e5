#!/usr/bin/env bash
# CI lane "parallel_hdf5": Debian's MPICH and parallel HDF5 (apt mpich libhdf5-mpich-dev),
# mpi4py and h5py built from source against them in their own venv (never pip's mpich),
# h5py.get_config().mpi checked, then the I/O, CLI, layer and cache-file tests at 1 and 2 ranks
# under the system mpiexec, and at 4 ranks those of the writer itself (tests/io, the cache files,
# the data-safety cases); without the tests of the signal protocol's interleavings and of the
# program's start, which involve no HDF5 (the main suite and the openmpi lane run them). Also
# checks that the main .venv (pip's MPICH) still loads its own libmpi once Debian's MPICH is
# installed.
# Why not every file at 4 ranks: Debian's MPICH 4.0.2 has no yielding wait (pip's MPICH 5 has
# MPIR_CVAR_ENABLE_HEAVY_YIELD; MPIR_CVAR_POLLS_BEFORE_YIELD=1 changed nothing), so 3 or 4 ranks
# on CI's 2 cores spin against each other: the layer's finite differences take 1.2 s at 2 ranks
# and 24 s at 3 (measured 2026-12-03, 2-core AMD EPYC VM). Every selected file at 4 ranks took
# 148 s, the writer's files alone 34 s; the CLI and the layer run at 4 ranks in the main suite.
# Last line: "LANE parallel_hdf5: PASS", "... FAIL (why)" or "... SKIP (why)".
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
# shellcheck source=.ci/lanes/lib.sh
. .ci/lanes/lib.sh
lane_init parallel_hdf5

VENV=$PWD/.ci/.venv-hdf5
PY=$VENV/bin/python
HDF5_DIR=/usr/lib/x86_64-linux-gnu/hdf5/mpich
NOTES=()

step "apt-get install mpich libhdf5-mpich-dev"
apt_install mpich libhdf5-mpich-dev || verdict SKIP "$APT_WHY"
for tool in /usr/bin/mpicc /usr/bin/mpiexec; do
    [[ -x $tool ]] || verdict FAIL "$tool missing after installing mpich"
done
/usr/bin/mpicc -show | grep -q mpich || verdict FAIL "/usr/bin/mpicc is not MPICH's: $(/usr/bin/mpicc -show)"
[[ -d $HDF5_DIR ]] || verdict FAIL "$HDF5_DIR missing after installing libhdf5-mpich-dev"

step "venv $VENV: mpi4py and h5py built from source against Debian's MPICH"
python3 -m venv "$VENV" || verdict FAIL "python3 -m venv failed"
# pip caches the wheels it builds and reuses them for the same source release whatever MPI
# they were built against. This lane's builds go to a cache of their own, outside the
# checkout, keyed by the compiler wrapper, the MPICH and HDF5 packages and the Python, so
# a rerun on this machine reuses them (a few seconds instead of several minutes) and a
# wheel built against another MPI is never picked up.
# Built without optimisation (-O0, the last -O on the compiler's line wins): the lane tests that
# the builds work against the site's MPI and HDF5, not their speed, and the compiler's -O2
# passes over mpi4py's and h5py's generated C were most of CI's time here (mpi4py 179 -> 29 s,
# h5py 155 -> 60 s on CI's 2 cores, measured 2026-12-07 without a pip cache).
export CFLAGS=-O0
key=$({ /usr/bin/mpicc -show; echo "CFLAGS=$CFLAGS"; dpkg-query -W libmpich-dev libhdf5-mpich-dev; "$PY" -VV; } | sha1sum | cut -c1-16)
export PIP_CACHE_DIR=/var/cache/mpiattn-ci/pip-debian-mpich-$key
echo "pip cache for this lane: $PIP_CACHE_DIR"
if ! "$PY" -c "import mpi4py" 2>/dev/null; then
    MPICC=/usr/bin/mpicc "$PY" -m pip install -q --no-binary=mpi4py mpi4py \
        || verdict FAIL "building mpi4py against /usr/bin/mpicc failed"
fi
"$PY" -m pip install -q 'setuptools>=77' numpy cython pkgconfig wheel \
    || verdict FAIL "pip install of h5py's build requirements failed"
if ! "$PY" -c "import h5py, sys; sys.exit(not h5py.get_config().mpi)" 2>/dev/null; then
    CC=/usr/bin/mpicc HDF5_MPI=ON HDF5_DIR=$HDF5_DIR "$PY" -m pip install -q \
        --no-build-isolation --no-binary=h5py h5py || verdict FAIL "building h5py against $HDF5_DIR failed"
fi
# mpiattn with the test tools, without the mpich extra (h5py and mpi4py are already there);
# bf16: ml_dtypes, so bfloat16 datasets are written with collective parallel HDF5 too
"$PY" -m pip install -q -e ".[test,bf16]" || verdict FAIL "pip install -e .[test,bf16] failed"

step "checks of the stack"
if "$PY" -m pip show -q mpich >/dev/null 2>&1; then
    verdict FAIL "pip's mpich got into the parallel HDF5 venv"
fi
lib=$("$PY" -m mpi4py --mpi-library) || verdict FAIL "python -m mpi4py --mpi-library failed"
echo "mpi4py loads: $lib"
[[ $lib == /usr/lib/* || $lib == /lib/* ]] || verdict FAIL "mpi4py loads $lib, not Debian's MPICH"
"$PY" -c "import h5py; print('h5py', h5py.version.version, 'HDF5', h5py.version.hdf5_version, 'mpi', h5py.get_config().mpi)"
"$PY" -c "import h5py, sys; sys.exit(not h5py.get_config().mpi)" \
    || verdict FAIL "h5py.get_config().mpi is False: h5py is not parallel"
timeout 120 /usr/bin/mpiexec -n 2 "$PY" -c "
import h5py, os, tempfile
from mpi4py import MPI
c = MPI.COMM_WORLD
path = c.bcast(tempfile.mktemp(suffix='.h5') if c.rank == 0 else None)
with h5py.File(path, 'w', driver='mpio', comm=c) as f:
    d = f.create_dataset('x', (c.size,), 'i8')
    with d.collective:
        d[c.rank] = c.rank
c.Barrier()
if c.rank == 0:
    with h5py.File(path, 'r') as f:
        assert list(f['x'][...]) == list(range(c.size))
    os.remove(path)
    print('collective mpio write on', c.size, 'ranks OK')
" || verdict FAIL "a collective write with h5py's mpio driver failed on 2 ranks"

# Debian's MPICH now owns /usr/bin/mpiexec and a system libmpi.so.12: the main .venv
# (pip's MPICH, reused by later sessions on this machine) must still load its own libmpi.
if [[ -x .venv/bin/python ]] && .venv/bin/python -c "import mpi4py" 2>/dev/null; then
    main_lib=$(.venv/bin/python -m mpi4py --mpi-library 2>&1)
    echo "main .venv's mpi4py loads: $main_lib"
    if [[ $main_lib != "$PWD/.venv/"* ]]; then
        verdict FAIL "after installing Debian's MPICH the main .venv loads $main_lib, not its own libmpi"
    fi
    NOTES+=("main .venv still loads its own libmpi")
fi

step "I/O, CLI, layer and cache-file tests at 1 and 2 ranks, the writer's at 4, with /usr/bin/mpiexec"
# Whatever the layout of tests/ (tests/test_io.py or tests/io/...), keep the test files whose
# path names io, cli or layer, and the key/value cache files' tests (KVCache.save writes
# through the same collective writer); ignore every other one.
ignores=()
kept=0
while IFS= read -r f; do
    if [[ /$f =~ /(test_)?(io|cli|layer)([_./]|$) || $f == */test_prefill_and_files.py ]]; then
        kept=$((kept + 1))
        echo "selected: tests/$f"
    else
        ignores+=("--ignore=$PWD/tests/$f")
    fi
done < <(cd tests && find . -name 'test_*.py' -not -path '*/.*' | sed 's|^\./||' | sort)
[[ $kept -gt 0 ]] || verdict FAIL "no I/O, CLI or layer test files found under tests/"
# at 4 ranks: the writer's own files (tests/io), the cache files' and the data-safety cases
ignores4=("${ignores[@]}")
kept4=0
while IFS= read -r f; do
    if [[ /$f =~ /(test_)?io([_./]|$) || $f == */test_prefill_and_files.py || $f == */test_data_safety.py ]]; then
        kept4=$((kept4 + 1))
    elif [[ " ${ignores[*]} " != *" --ignore=$PWD/tests/$f "* ]]; then
        ignores4+=("--ignore=$PWD/tests/$f")
    fi
done < <(cd tests && find . -name 'test_*.py' -not -path '*/.*' | sed 's|^\./||' | sort)
[[ $kept4 -gt 0 ]] || verdict FAIL "no I/O test files found under tests/ for the 4-rank session"
SELECT="not whichever_handler_runs_first and not while_the_program_starts and not ctrl_c"
PATH=$VENV/bin:$PATH "$PY" tests/run_all.py --ranks 1,2 "${ignores[@]}" -k "$SELECT" \
    | tee "$LANE_TMP/run_all-1-2.log"
rc=${PIPESTATUS[0]}
[[ $rc == 0 ]] || verdict FAIL "tests/run_all.py at 1, 2 ranks exited $rc: $(suite_summary "$LANE_TMP/run_all-1-2.log")"
PATH=$VENV/bin:$PATH "$PY" tests/run_all.py --ranks 4 "${ignores4[@]}" -k "$SELECT" \
    | tee "$LANE_TMP/run_all-4.log"
rc=${PIPESTATUS[0]}
[[ $rc == 0 ]] || verdict FAIL "tests/run_all.py at 4 ranks exited $rc: $(suite_summary "$LANE_TMP/run_all-4.log")"
# one summary line for .ci/run: the two runs' totals summed
cat "$LANE_TMP"/run_all-*.log | grep -aE '^[0-9]+ passed, [0-9]+ failed, [0-9]+ skipped$' \
    | awk '{p += $1; f += $3; s += $5} END {print p " passed, " f " failed, " s " skipped"}'
echo "notes: ${NOTES[*]:-none}"
verdict PASS
