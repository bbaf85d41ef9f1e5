#!/bin/bash
# mpiattn on a PBS Pro / OpenPBS cluster: info -> make-data -> run -> check, on GPUs (one rank per
# GPU) or on CPUs. The header asks for no GPUs, so the script runs on CPU queues as it is.
# Submit on CPUs:  qsub jobs/pbs.sh
# Submit on GPUs:  qsub -l select=2:ncpus=32:ngpus=4:mpiprocs=4 -v DEVICE=gpu jobs/pbs.sh
# Resize with:     qsub -l select=4:ncpus=32:mpiprocs=4 -v SEQ=262144 jobs/pbs.sh
# Adapting it to a site: see jobs/README.md.
#PBS -N mpiattn
#PBS -l select=2:ncpus=32:mpiprocs=4
#PBS -l walltime=00:30:00
#PBS -j oe
# (above: job name; 2 chunks (nodes) of 32 cores with 4 MPI ranks each (on GPUs: add ngpus=4,
#  one GPU per rank); 30 min limit; stdout and stderr joined into one file)
# Site-specific lines, uncomment and fill in as your centre requires:
##PBS -q gpu
##PBS -A PROJECT
##PBS -l filesystems=home:scratch

set -euo pipefail                      # stop at the first failing command or unset variable
cd "${PBS_O_WORKDIR:-$PWD}"            # PBS starts jobs in $HOME: go back to where qsub was run

# ---------------------------------------------------------------- software
# module load cuda/12.4 cray-mpich     # the CUDA and MPI that mpi4py and CuPy were built against
# source "$HOME/venvs/mpiattn/bin/activate"   # a venv with: pip install "mpiattn[cuda12]"
PYTHON=${PYTHON:-python}               # the interpreter that has mpiattn installed

# ---------------------------------------------------------------- ranks
NODES=$(sort -u "${PBS_NODEFILE:?not inside a PBS job}" | wc -l)   # distinct hosts of the job
NRANKS=$(wc -l < "$PBS_NODEFILE")      # one line per MPI rank (mpiprocs per chunk)
PPN=$((NRANKS / NODES))                # ranks per node = GPUs per node
# The launcher: PBS Pro / Cray PALS mpiexec takes -n and --ppn. With Open MPI use instead:
#   MPIEXEC=(mpirun -np "$NRANKS" --map-by "ppr:$PPN:node" --bind-to core)
# Never restrict CUDA_VISIBLE_DEVICES per rank: mpiattn picks the GPU of node-local rank i itself.
MPIEXEC=(mpiexec -n "$NRANKS" --ppn "$PPN")
JOBINFO=$(qstat -f "${PBS_JOBID:-none}" 2>/dev/null || true)   # the job's resources; empty without qstat

# ---------------------------------------------------------------- problem size
BATCH=${BATCH:-1}                      # B
HEADS=${HEADS:-8}                      # H query heads
KV_HEADS=${KV_HEADS:-8}                # Hkv key/value heads (H must be a multiple)
SEQ=${SEQ:-131072}                     # N = M tokens of the big run
DIM=${DIM:-64}                         # E = Ev features per head
DTYPE=${DTYPE:-float32}                # stored and compute dtype (float16, float32, float64)
CHECK_SEQ=${CHECK_SEQ:-8192}           # tokens of the verified run (the float64 reference is O(N^2))
SEED=${SEED:-0}                        # make-data seed: same data for any number of ranks
# DEVICE: gpu (one per rank; fail if absent), auto, or cpu (NumPy). Default: gpu when the job has
# GPUs (ngpus in its select line), cpu otherwise.
NGPUS=$(sed -n 's/^ *Resource_List.ngpus = //p' <<<"$JOBINFO")   # GPUs of the whole job, if any
if [[ ${NGPUS:-0} -gt 0 ]]; then DEVICE=${DEVICE:-gpu}; else DEVICE=${DEVICE:-cpu}; fi  # see above

# ---------------------------------------------------------------- files
WORKDIR=${WORKDIR:-$PWD}               # a parallel file system directory every node sees
JOB=${PBS_JOBID:-local}                # job id, to keep runs apart
JOB=${JOB%%.*}                         # drop the server name from "1234.server"
INPUT="$WORKDIR/mpiattn-in-$JOB.h5"    # big input (written by make-data)
OUTPUT=${OUTPUT:-"$WORKDIR/mpiattn-out-$JOB.h5"}  # big output: out, lse, dq, dk, dv (replaced if present)
CHECK_IN="$WORKDIR/mpiattn-check-in-$JOB.h5"    # small input for the verified run
CHECK_OUT="$WORKDIR/mpiattn-check-out-$JOB.h5"  # its output

# ---------------------------------------------------------------- GPU and MPI switches
# How device buffers cross ranks: auto | cuda-aware | staged | nccl.
#   auto       cuda-aware when every rank's MPI says it handles CUDA memory, else staged (with a notice)
#   cuda-aware hand device pointers to MPI (needs a CUDA-aware MPI, e.g. Open MPI+UCX, Cray MPICH)
#   staged     copy through pinned host buffers (works with any MPI)
#   nccl       ring exchanges through NCCL (needs one GPU per rank)
export MPIATTN_GPU_TRANSPORT=${MPIATTN_GPU_TRANSPORT:-auto}
# export MPICH_GPU_SUPPORT_ENABLED=1   # Cray MPICH: turn GPU-aware MPI on (auto then picks cuda-aware)
# export OMPI_MCA_opal_cuda_support=1  # Open MPI built with CUDA: make sure its CUDA support is on
# export MPIATTN_DEVICE=0,1,2,3        # override the GPU of node-local rank i (default: i % GPUs)

# CPU threads per rank (BLAS, OpenMP) = the chunk's cores (NCPUS) / its ranks (PPN). PBS itself sets
# OMP_NUM_THREADS to the whole chunk's ncpus (unless ompthreads= is given), which would put PPN
# times too many threads on each node: that value is replaced; any other one set by the user stays.
THREADS=$(( ${NCPUS:-$PPN} / PPN > 0 ? ${NCPUS:-$PPN} / PPN : 1 ))   # at least one
# (unset, or PBS's per-chunk default: use THREADS)
if [[ -z ${OMP_NUM_THREADS:-} || ${OMP_NUM_THREADS} == "${NCPUS:-}" ]]; then export OMP_NUM_THREADS=$THREADS; fi
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-$OMP_NUM_THREADS}   # NumPy's OpenBLAS: the same
export HDF5_USE_FILE_LOCKING=FALSE     # Lustre/GPFS mounts without flock reject HDF5's file locks

# Graceful time limit: PBS sends SIGTERM only at the walltime and SIGKILL soon after (kill_delay,
# often 10 s), so each step gets SIGTERM from `timeout` GRACE seconds before the walltime instead;
# mpiattn then stops cleanly and the cleanup below runs. Without qstat (a local run): no limit.
GRACE=${GRACE:-120}                    # seconds kept in hand before the walltime
WALLTIME=$(sed -n 's/^ *Resource_List.walltime = //p' <<<"$JOBINFO")   # HH:MM:SS; empty outside PBS
DEADLINE=""                            # $SECONDS (since the job started) at which to stop a step
if [[ $WALLTIME =~ ^([0-9]+):([0-9]+):([0-9]+)$ ]]; then  # 10#: hours like "08" are not octal
    DEADLINE=$((10#${BASH_REMATCH[1]} * 3600 + 10#${BASH_REMATCH[2]} * 60 + 10#${BASH_REMATCH[3]} - GRACE))
fi                                     # (no walltime found: steps run without a deadline)
# Each step runs in the background while the script waits for it: bash runs a trap only between
# commands, but `wait` returns as soon as a trapped signal arrives. So on qdel the inputs are
# removed at once, not after the launcher ends (PBS kills the job's shell kill_delay later).
STEP=""                                # process id of the running step, empty between steps
launch() {                             # launch ARGS...: run ARGS on all ranks, within the deadline
    if [[ -z $DEADLINE ]]; then "${MPIEXEC[@]}" "$@" & STEP=$!  # no deadline: plain launcher
    else                               # a deadline: TERM from timeout when it comes
        local left=$((DEADLINE - SECONDS > 1 ? DEADLINE - SECONDS : 1))  # seconds left, at least 1
        timeout --signal=TERM --kill-after=60 "$left" "${MPIEXEC[@]}" "$@" & STEP=$!  # the step
    fi                                 # (either way STEP is the step's process id)
    wait "$STEP"; STEP=""              # fail as the step fails
}                                      # end of launch

# On failure (a failing step, qdel, the time limit) remove the inputs this job generated;
# mpiattn writes each file under a temporary name and renames it when complete, so outputs are
# either whole or absent. GENERATED lists the inputs made so far.
GENERATED=()
on_exit() {                            # the EXIT trap
    local rc=$?                        # the script's exit status
    if ((rc != 0 && ${#GENERATED[@]} > 0)); then  # failed after making inputs: remove them
        rm -f "${GENERATED[@]}"        # -f: some may not exist yet
        echo "mpiattn job $JOB failed (exit $rc); removed its inputs: ${GENERATED[*]}" >&2  # say so
    fi                                 # (no failure, or nothing generated yet: keep everything)
    if [[ -n $STEP ]]; then wait "$STEP" 2>/dev/null || true; fi  # a signalled step: let it end
}                                      # end of on_exit
trap on_exit EXIT                      # runs on any exit, including the ones below
trap 'exit 143' TERM                   # SIGTERM (qdel, walltime): exit 128+15, via on_exit
trap 'exit 130' INT                    # Ctrl-C when run by hand: exit 128+2, via on_exit

# A GPU run in a job without GPUs fails in step 3; say why up front.
if [[ $DEVICE == gpu && -n $JOBINFO && ${NGPUS:-0} -eq 0 ]]; then echo "warning: DEVICE=gpu but this job has no GPUs (add ngpus=N to its select line)" >&2; fi

# Say what runs where (lands at the top of the job's output file).
echo "mpiattn job $JOB: $NRANKS ranks on $NODES nodes ($PPN per node), N=$SEQ, device $DEVICE, output $OUTPUT"

# 1. What the job sees: versions, ranks per host, GPUs per rank, CUDA-aware decision, parallel HDF5.
launch "$PYTHON" -m mpiattn info

GENERATED+=("$INPUT")                  # from here on a failure removes the big input
# 2. Input: every rank generates and writes only its own rows (deterministic for SEED).
launch "$PYTHON" -m mpiattn make-data "$INPUT" --batch "$BATCH" --heads "$HEADS" \
    --kv-heads "$KV_HEADS" --seq "$SEQ" --dim "$DIM" --dtype "$DTYPE" --with-dout --causal \
    --seed "$SEED" --force

# 3. The big run: forward + backward (the input has dout), causal, on DEVICE; timings printed.
launch "$PYTHON" -m mpiattn run "$INPUT" -o "$OUTPUT" --device "$DEVICE" --strategy auto --force

GENERATED+=("$CHECK_IN")               # from here on a failure removes the small input too
# 4. Check: make a smaller input that the float64 reference can handle (O(N^2) on rank 0) ...
launch "$PYTHON" -m mpiattn make-data "$CHECK_IN" --batch "$BATCH" --heads "$HEADS" \
    --kv-heads "$KV_HEADS" --seq "$CHECK_SEQ" --dim "$DIM" --dtype "$DTYPE" --with-dout --causal \
    --seed "$SEED" --force
# ... and run it with --check (gathers to rank 0, compares with float64 NumPy).
launch "$PYTHON" -m mpiattn run "$CHECK_IN" -o "$CHECK_OUT" --device "$DEVICE" --check --force

# 5. Tidy up the big input (comment out to keep it); the outputs stay.
rm -f "$INPUT"                         # -f: no error if it is already gone
# Where the results are.
echo "done: $OUTPUT (verified on N=$CHECK_SEQ: $CHECK_OUT)"
