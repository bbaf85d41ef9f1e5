#!/usr/bin/env bash
# CI lane "two_nodes": the two-level strategies on two emulated nodes. pip's MPICH with
# MPIR_CVAR_NUM_CLIQUES=2 makes MPI_Comm_split_type(SHARED) see 2 nodes at mpiexec -n 4
# (ranks {0,2} and {1,3}; messages still go through shared memory: the topology is emulated,
# not the link speeds). Runs, at 4 ranks: the topology tests, the shared contract suite for
# every ring, double-ring and hybrid split (both placements), the bytes-per-link-class
# formulas, and the cost model's tests. Uses the main suite's venv (.venv, made by .ci/run).
# Last line: "LANE two_nodes: PASS", "LANE two_nodes: FAIL (why)" or "LANE two_nodes: SKIP (why)".
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
# shellcheck source=.ci/lanes/lib.sh
. .ci/lanes/lib.sh
lane_init two_nodes

PY=$PWD/.venv/bin/python
[[ -x $PY ]] || verdict FAIL "no .venv: the main suite's step (README's test command) did not make it"
export MPIR_CVAR_NUM_CLIQUES=2 MPIR_CVAR_ENABLE_HEAVY_YIELD=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

step "mpiexec -n 4 sees two nodes"
timeout 120 "$PWD/.venv/bin/mpiexec" -n 4 "$PY" -c "
from mpiattn.comm import get_comm
t = get_comm().topology
assert t.nodes == ((0, 2), (1, 3)), t
get_comm().rank or print('topology:', t.describe(), t.nodes)" || verdict FAIL "MPICH's cliques did not give two nodes"

step "contract suite (ring, double-ring, every hybrid split), traffic, model, topology at 4 ranks"
timeout 1500 "$PWD/.venv/bin/mpiexec" -n 4 "$PY" -m pytest --with-mpi -q -p no:cacheprovider -rfE \
    tests/core/test_topology.py tests/attention/test_traffic.py tests/attention/test_model.py \
    "tests/attention/test_contract.py" -k "not test_contract or ring or hybrid" | tee "$LANE_TMP/pytest.log"
rc=${PIPESTATUS[0]}
"$PY" - "$LANE_TMP/pytest.log" <<'PYEOF'  # one summary line in .ci/run's format (rank 0's counts)
import re, sys
lines = [ln for ln in open(sys.argv[1], errors="replace") if re.search(r"\d+ (passed|failed)", ln)]
c = dict.fromkeys(("passed", "failed", "skipped"), 0)
for n, w in re.findall(r"(\d+) (passed|failed|skipped)", lines[-1] if lines else ""):
    c[w] = int(n)
print(f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped")
PYEOF
[[ $rc == 0 ]] || verdict FAIL "pytest under 2 emulated nodes exited $rc: $(suite_summary "$LANE_TMP/pytest.log")"
verdict PASS
