#!/usr/bin/env bash
# CI lane "two_hosts": two real hosts on this machine (jobs/two_hosts.sh: network namespaces
# joined by a veth pair, each with its own hostname and /dev/shm), the link between them
# limited to 400 Mbit/s (tc tbf), pip's MPICH launched by Hydra over the ssh wrapper, TCP
# between the hosts (FI_PROVIDER=tcp, MPIR_CVAR_CH4_NETMOD=ofi) and shared memory inside each.
# It replaces the two_nodes lane (MPICH's cliques: two emulated nodes, every message still in
# shared memory), covering all it ran on real nodes. At 2 hosts x 2 ranks (nodes {0,1}, {2,3}):
#   * MPI sees two nodes, in blocks and (ranks alternating hosts) interleaved;
#   * tests/two_hosts/test_on_two_hosts.py: the bytes counted between hosts against the
#     formulas and the veth counters, decode over a cache on both hosts, `run` writing one HDF5
#     file from both hosts, calibrate finding the limited link;
#   * the topology, traffic, cost-model and link tests, decode, and the shared contract suite
#     for ring, double-ring, every hybrid split (both placements), allgather and ulysses
#     (FlashAttention's shape sweep included) - two_nodes' files and subset, and more; the
#     score modifiers on the two-level strategies (tests/attention/test_modifiers.py: hybrid
#     splits and the double ring); score_mod on every strategy, NumPy (ScoreMod) and torch
#     (autograd, captured tensors' gradients), against a float64 torch autograd reference;
#   * interleaved (-per-host 1: nodes {0,2}, {1,3}): topology, traffic and the contract suite of
#     the two-level strategies without the shape sweep;
#   * the search over the contract (tests/attention/test_property.py: hypothesis' drawn calls,
#     100 of them, in the collective checking mode);
#   * the fault cases, from outside the cluster (tests/two_hosts/test_faults.py: SIGKILL of one
#     host's ranks, the link cut during a ring step, SIGTERM to the launcher during a write);
#   * Open MPI over the same hosts (plm_rsh_agent), when the openmpi lane left its venv.
# The cluster is removed however the lane ends. Uses the main suite's venv (.venv).
# Last line: "LANE two_hosts: PASS", "LANE two_hosts: FAIL (why)" or "LANE two_hosts: SKIP (why)"
# (SKIP: this machine cannot make network namespaces, e.g. not root or inside a container).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
# shellcheck source=.ci/lanes/lib.sh
. .ci/lanes/lib.sh
lane_init two_hosts

PY=$PWD/.venv/bin/python
[[ -x $PY ]] || verdict FAIL "no .venv: the main suite's step (README's test command) did not make it"
CLUSTER=jobs/two_hosts.sh
export MPIATTN_CLUSTER=mpiattn-ci$$   # names of its own: another run's cluster is left alone
# shellcheck disable=SC2329  # called by lib.sh's EXIT trap
lane_cleanup() { bash "$CLUSTER" down; }

step "make the cluster (jobs/two_hosts.sh up --rate 400mbit)"
out=$(bash "$CLUSTER" up --rate 400mbit 2>&1)
rc=$?
echo "$out"
[[ $rc == 77 ]] && verdict SKIP "${out#SKIP: }"
[[ $rc == 0 ]] || verdict FAIL "jobs/two_hosts.sh up failed (exit $rc)"

export PATH=$PWD/.venv/bin:$PATH MPIR_CVAR_ENABLE_HEAVY_YIELD=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export MPIATTN_TWO_HOSTS=1 MPIATTN_TWO_HOSTS_RATE_BPS=400000000 PYTHONUNBUFFERED=1
mpx() { timeout -k 10 "$1" bash "$CLUSTER" mpiexec "${@:2}"; }

TOPO='
import socket, sys
from mpiattn.comm import get_comm
c = get_comm()
want = eval(sys.argv[1])
names = c.allgather_obj(socket.gethostname())
assert c.topology.nodes == want, (c.topology.nodes, want)
assert all(names[a] == names[n[0]] for n in want for a in n) and len(set(names)) == 2, names
c.rank or print("topology:", c.topology.describe(), c.topology.nodes, "hosts", names)'
step "MPI sees two nodes: blocks, and interleaved"
mpx 120 -n 4 "$PY" -c "$TOPO" "((0, 1), (2, 3))" || verdict FAIL "2 hosts x 2 ranks are not two nodes {0,1}, {2,3}"
mpx 120 -per-host 1 -n 4 "$PY" -c "$TOPO" "((0, 2), (1, 3))" \
    || verdict FAIL "ranks alternating hosts are not two nodes {0,2}, {1,3}"

LOGS=()
pytest_on() {  # pytest_on LIMIT LOG MPIEXEC-ARGS... -- PYTEST-ARGS...
    local limit=$1 log=$LANE_TMP/$2.log
    shift 2
    local mpi=()
    while [[ $1 != -- ]]; do mpi+=("$1"); shift; done
    shift
    LOGS+=("$log")
    mpx "$limit" "${mpi[@]}" "$PY" -m pytest --with-mpi -q -p no:cacheprovider -rfE "$@" | tee "$log"
    return "${PIPESTATUS[0]}"
}

step "on 2 hosts x 2 ranks: the two-host tests, topology, traffic, model, links, decode, contract suite, score_mod"
pytest_on 420 blocks -n 4 -- -s tests/two_hosts/test_on_two_hosts.py tests/core/test_topology.py \
    tests/attention/test_traffic.py tests/attention/test_model.py tests/attention/test_links.py \
    tests/inference/test_decode.py tests/attention/test_contract.py tests/attention/test_modifiers.py \
    tests/attention/test_score_mod.py tests/torch_interface/test_torch_score_mod.py \
    -k "(not test_contract and not test_every_modifier) or (test_contract and (ring or hybrid or allgather or ulysses)) or (test_every_modifier and (hybrid or double-ring))"
blocks_rc=$?

step "interleaved (ranks alternate hosts): topology, traffic, the two-level strategies' contract cases"
pytest_on 200 interleaved -per-host 1 -n 4 -- tests/core/test_topology.py tests/attention/test_traffic.py \
    tests/attention/test_contract.py -k "not test_contract or ((double-ring or hybrid) and not flash)"
interleaved_rc=$?

step "on 2 hosts x 2 ranks: the search over the contract (tests/attention/test_property.py, 100 calls)"
export MPIATTN_PROPERTY_EXAMPLES=100
pytest_on 300 search -n 4 -- -s tests/attention/test_property.py
search_rc=$?
unset MPIATTN_PROPERTY_EXAMPLES

step "fault cases, from outside the cluster"
LOGS+=("$LANE_TMP/faults.log")
timeout -k 10 240 "$PY" -m pytest --with-mpi -q -p no:cacheprovider -rfE -s tests/two_hosts/test_faults.py \
    | tee "$LANE_TMP/faults.log"
faults_rc=${PIPESTATUS[0]}

ompi_rc=0
OMPI=$PWD/.ci/.venv-openmpi
if [[ -x $OMPI/bin/mpirun && -x $OMPI/bin/python ]]; then
    step "Open MPI over the two hosts (the openmpi lane's venv)"
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PATH=$OMPI/bin:$PATH \
        timeout -k 10 120 bash "$CLUSTER" mpirun -n 4 -x PATH -x OMPI_MCA_mpi_yield_when_idle=1 \
        "$OMPI/bin/python" -c "$TOPO" "((0, 1), (2, 3))"
    ompi_rc=$?
else
    step "Open MPI over the two hosts: not run (no .ci/.venv-openmpi: the openmpi lane makes it)"
fi

sum_summaries "${LOGS[@]}"
bash "$CLUSTER" counters
[[ $blocks_rc == 0 ]] || verdict FAIL "pytest on 2 hosts x 2 ranks exited $blocks_rc: $(suite_summary "$LANE_TMP/blocks.log")"
[[ $interleaved_rc == 0 ]] || verdict FAIL "pytest on interleaved hosts exited $interleaved_rc"
[[ $search_rc == 0 ]] || verdict FAIL "the search over the contract on 2 hosts exited $search_rc: $(suite_summary "$LANE_TMP/search.log")"
[[ $faults_rc == 0 ]] || verdict FAIL "the fault cases exited $faults_rc: $(suite_summary "$LANE_TMP/faults.log")"
[[ $ompi_rc == 0 ]] || verdict FAIL "Open MPI over the two hosts failed (exit $ompi_rc)"
verdict PASS
