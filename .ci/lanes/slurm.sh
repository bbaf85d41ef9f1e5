#!/usr/bin/env bash
# CI lane "slurm": a one-node SLURM cluster on localhost (apt slurm-wlm munge, configured and
# run in a temporary directory, daemons stopped at the end whatever happens). Job 0 checks the
# launch check inside a batch script: a singleton, mpiexec and srun pass, srun --mpi=none is
# stopped with one message that names the fix. Then it submits jobs/slurm.sbatch with DEVICE=cpu at small sizes with the main .venv (pip's MPICH), waits
# for it and checks its exit state and outputs; then submits a bigger job that writes over
# the first job's output, scancels it while it writes, and checks that no temporary file is
# left behind, that the first job's files are unchanged and that the job removed its input.
# Last line: "LANE slurm: PASS", "LANE slurm: FAIL (why)" or "LANE slurm: SKIP (why)".
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
# shellcheck source=.ci/lanes/lib.sh
. .ci/lanes/lib.sh
lane_init slurm

ROOT=$PWD
PY=$ROOT/.venv/bin/python
D=""            # the cluster's temporary directory
PIDS=()         # daemons started here: munged, slurmctld, slurmd

# shellcheck disable=SC2329  # called by lib.sh's EXIT trap
lane_cleanup() {
    [[ -n $D ]] || return 0
    if [[ -n ${SLURM_CONF:-} ]] && ((${#PIDS[@]} > 1)); then
        # no job may outlive its slurmd: cancel what is left and give it time to end
        local ids
        ids=$(squeue -h -o %i 2>/dev/null)
        if [[ -n $ids ]]; then
            # shellcheck disable=SC2086
            scancel $ids 2>/dev/null
            for _ in $(seq 60); do [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break; sleep 1; done
        fi
    fi
    local pid
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
    for pid in "${PIDS[@]}"; do
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -KILL "$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
    done
    if [[ $LANE_VERDICT != PASS ]]; then
        echo "--- slurm lane logs (last lines):"
        local f
        for f in "$D"/log/*.log "$D"/work/job-*.out; do
            [[ -f $f ]] && { echo "--- $f"; tail -n 30 "$f"; }
        done
    fi
    rm -rf "$D"
    echo "slurm daemons stopped, $D removed"
}

job_state() {  # job_state ID: "STATE EXITCODE" from scontrol (no accounting database here)
    scontrol show job "$1" 2>/dev/null | tr ' ' '\n' | grep -E '^(JobState|ExitCode)=' | cut -d= -f2 | paste -sd' ' -
}

wait_job() {  # wait_job ID SECONDS: until the job has ended; prints its final "STATE EXITCODE"
    local st
    for _ in $(seq "$2"); do
        st=$(job_state "$1")
        case ${st%% *} in PENDING | RUNNING | COMPLETING | CONFIGURING | SUSPENDED | "") sleep 1 ;; *) break ;; esac
    done
    # squeue lists a job until its processes are gone (state CG while they end)
    for _ in $(seq "$2"); do [[ -z $(squeue -h -j "$1" -o %T 2>/dev/null) ]] && break; sleep 1; done
    job_state "$1"
}

step "apt-get install slurm-wlm munge"
apt_install slurm-wlm munge || verdict SKIP "$APT_WHY"
for tool in munged mungekey slurmctld slurmd sbatch squeue scontrol scancel srun; do
    command -v "$tool" >/dev/null || verdict FAIL "$tool missing after installing slurm-wlm munge"
done

if [[ ! -x $PY ]] || ! "$PY" -c "import mpiattn, h5py" 2>/dev/null; then
    step "main .venv missing: creating it as the README does"
    { python3 -m venv .venv && .venv/bin/pip install -q -e ".[mpich,test]"; } || verdict FAIL "creating the main .venv failed"
fi
lib=$("$PY" -m mpi4py --mpi-library 2>&1)
[[ $lib == "$ROOT/.venv/"* ]] || verdict FAIL "the main .venv loads $lib, not pip's MPICH"

step "one-node cluster in a temporary directory"
D=$(mktemp -d /tmp/mpiattn-slurm.XXXXXX)
chmod 755 "$D"                                  # munged wants its socket's directory searchable
mkdir -p "$D/state" "$D/spool" "$D/log" "$D/work" "$D/munge" "$D/run"
chmod 700 "$D/munge"                            # the key's directory: owner only
mungekey -c -b 1024 -k "$D/munge/munge.key" || verdict FAIL "mungekey failed"
munged -F --socket="$D/run/munge.sock" --key-file="$D/munge/munge.key" --pid-file="$D/munge/munged.pid" \
    --seed-file="$D/munge/munged.seed" --log-file="$D/log/munged.log" >>"$D/log/munged.out" 2>&1 &
PIDS+=($!)
for _ in $(seq 50); do [[ -S $D/run/munge.sock ]] && break; sleep 0.2; done
munge -S "$D/run/munge.sock" -n | unmunge -S "$D/run/munge.sock" >/dev/null || verdict FAIL "munged does not answer"

HOST=$(hostname -s)
# Job ids of their own: MPICH names its shared-memory segment after the job step ("JOB.STEP"
# under srun), and a step killed by scancel leaves /dev/shm/mpich_shm_* behind; with ids
# starting at 1 in every run, a later run's step would open the stale segment and fail in
# MPI_Init ("Message truncated"). Seconds since the epoch keep ids apart between runs.
FIRST_JOB_ID=$(($(date +%s) % 60000000 + 1000))
read -r CTLD_PORT SLURMD_PORT < <(python3 -c "
import socket
ss = [socket.socket() for _ in range(2)]
for s in ss: s.bind(('127.0.0.1', 0))
print(*(s.getsockname()[1] for s in ss))")
cat >"$D/slurm.conf" <<EOF
ClusterName=mpiattnci
FirstJobId=$FIRST_JOB_ID
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$D/run/munge.sock
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=pmi2
SchedulerType=sched/backfill
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait=30
MinJobAge=3600
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=ci Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$D/slurm.conf
slurmctld -D -f "$SLURM_CONF" >>"$D/log/slurmctld.out" 2>&1 &
PIDS+=($!)
slurmd -D -f "$SLURM_CONF" -N "$HOST" >>"$D/log/slurmd.out" 2>&1 &
PIDS+=($!)
state=""
for _ in $(seq 60); do
    state=$(sinfo -h -n "$HOST" -o %T 2>/dev/null)
    [[ $state == idle ]] && break
    sleep 1
done
[[ $state == idle ]] || verdict FAIL "the node did not come up (state '${state:-none}')"
sinfo
timeout 60 srun -n 2 "$PY" -c "from mpi4py import MPI; c = MPI.COMM_WORLD; assert c.size == 2; c.rank or print('srun: 2 ranks OK')" \
    || verdict FAIL "srun -n 2 of an mpi4py hello world failed"

W=$D/work
# Every job: one node, 2 ranks of 1 CPU (the header asks for 2 nodes x 4 ranks x 8 CPUs),
# CPUs only, the main .venv's Python, files in $W.
SUBMIT=(sbatch --parsable --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 --chdir="$W" --output="$W/job-%j.out")
COMMON="ALL,DEVICE=cpu,PYTHON=$PY,WORKDIR=$W,CHECK_SEQ=64"

step "job 0: the launch check inside a batch script (singleton, mpiexec, srun, srun --mpi=none)"
# What the batch step itself exports (is SLURM_STEP_NUM_TASKS set there?), and that the check
# of the ranks' count lets each right launch through and stops the broken one with its fix.
cat >"$D/launch.sh" <<EOF
#!/bin/bash
env | grep -E '^SLURM_(STEP_NUM_TASKS|NTASKS|STEP_ID)=' | sort | sed 's/^/batch step: /'
"$PY" -m mpiattn info >/dev/null; echo "singleton in the batch step: exit \$?"
"$ROOT/.venv/bin/mpiexec" -n 2 "$PY" -m mpiattn info >/dev/null; echo "mpiexec -n 2: exit \$?"
srun -n 2 "$PY" -m mpiattn info >/dev/null; echo "srun -n 2: exit \$?"
srun --mpi=none -n 2 "$PY" -m mpiattn info >/dev/null; echo "srun --mpi=none -n 2: exit \$?"
EOF
J0=$("${SUBMIT[@]}" "$D/launch.sh") || verdict FAIL "sbatch of job 0 was refused"
st=$(wait_job "$J0" 180)
echo "job 0 (SLURM job $J0): $st"
cat "$W/job-$J0.out"
for want in "singleton in the batch step: exit 0" "mpiexec -n 2: exit 0" "srun -n 2: exit 0" \
            "srun --mpi=none -n 2: exit 1" "Fix: "; do
    grep -q "$want" "$W/job-$J0.out" || verdict FAIL "job 0's log lacks '$want'"
done
[[ $(grep -c "each one's MPI sees only itself" "$W/job-$J0.out") == 1 ]] \
    || verdict FAIL "job 0: srun --mpi=none was not stopped with one message"

step "job 1: jobs/slurm.sbatch, DEVICE=cpu, small"
J1=$("${SUBMIT[@]}" --export="$COMMON,SEQ=512,DIM=16,HEADS=2,KV_HEADS=1" jobs/slurm.sbatch) \
    || verdict FAIL "sbatch of job 1 was refused"
st=$(wait_job "$J1" 300)
echo "job 1 (SLURM job $J1): $st"
cat "$W/job-$J1.out"
[[ $st == "COMPLETED 0:0" ]] || verdict FAIL "job 1 ended as '$st', not 'COMPLETED 0:0'"
grep -q " OK" "$W/job-$J1.out" || verdict FAIL "job 1's log has no OK from its --check run"
OUT1=$W/mpiattn-out-$J1.h5
"$PY" - "$OUT1" "$W/mpiattn-check-out-$J1.h5" <<'EOF' || verdict FAIL "job 1's outputs are not as expected"
import sys
import h5py
want = {"out": (1, 2, 512, 16), "lse": (1, 2, 512), "dq": (1, 2, 512, 16),
        "dk": (1, 1, 512, 16), "dv": (1, 1, 512, 16)}
with h5py.File(sys.argv[1], "r") as f:
    got = {name: f[name].shape for name in f}
    assert got == want, f"{sys.argv[1]}: datasets {got}, expected {want}"
    assert f.attrs["ranks"] == 2, f.attrs["ranks"]
with h5py.File(sys.argv[2], "r") as f:
    assert {"out", "lse", "dq", "dk", "dv"} <= set(f), set(f)
print("job 1 outputs OK:", ", ".join(f"{k} {v}" for k, v in got.items()))
EOF
[[ ! -e $W/mpiattn-in-$J1.h5 ]] || verdict FAIL "job 1 left its big input behind"
(cd "$W" && sha256sum ./*.h5 >"$D/before.sha256") || verdict FAIL "sha256sum failed"
stat -c '%n %Y %s' "$W"/*.h5 >"$D/before.stat"

step "job 2: bigger, writing over job 1's output; scancel while it writes"
# float64, 256 MiB of outputs: the output's temporary file exists for a few seconds
J2=$("${SUBMIT[@]}" --export="$COMMON,OUTPUT=$OUT1,SEQ=256,BATCH=8,HEADS=32,KV_HEADS=32,DIM=128,DTYPE=float64" \
    jobs/slurm.sbatch) || verdict FAIL "sbatch of job 2 was refused"
tmp_glob=".$(basename "$OUT1").mpiattn-*.tmp"
seen=""
for _ in $(seq 6000); do  # up to about 5 minutes
    seen=$(cd "$W" && compgen -G "$tmp_glob" | head -n 1)
    [[ -n $seen ]] && break
    case $(job_state "$J2") in PENDING* | RUNNING* | CONFIGURING* | "") ;; *) break ;; esac
    sleep 0.05
done
if [[ -z $seen ]]; then
    st=$(wait_job "$J2" 60)
    cat "$W/job-$J2.out"
    verdict FAIL "job 2 ended ($st) before its output's temporary file $tmp_glob appeared"
fi
scancel "$J2"
echo "saw $seen: scancel $J2 (job 2)"
st=$(wait_job "$J2" 120)
echo "job 2 (SLURM job $J2): $st"
cat "$W/job-$J2.out"
problems=()
[[ $st == CANCELLED* ]] || problems+=("job 2 ended as '$st', not CANCELLED")
left=$(cd "$W" && compgen -G ".*.mpiattn-*.tmp" | paste -sd' ' -)
[[ -z $left ]] || problems+=("temporary file(s) left behind after scancel: $left")
(cd "$W" && sha256sum --quiet -c "$D/before.sha256") || problems+=("job 1's files were modified by the cancelled job")
stat -c '%n %Y %s' "$W"/*.h5 | diff "$D/before.stat" - || problems+=("the set, times or sizes of the .h5 files changed")
[[ ! -e $W/mpiattn-in-$J2.h5 ]] || problems+=("the cancelled job left its input mpiattn-in-$J2.h5 behind")
ls -la "$W"
if ((${#problems[@]} > 0)); then
    printf 'problem: %s\n' "${problems[@]}"
    why=$(printf '%s; ' "${problems[@]}")
    verdict FAIL "${why%; }"
fi
verdict PASS
