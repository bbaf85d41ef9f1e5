#!/bin/bash
# mpiattn on a PBS Pro / OpenPBS GPU cluster: info -> make-data -> run -> check, one rank per GPU.
# Submit with:   qsub jobs/pbs.sh
# Resize with:   qsub -l select=4:ncpus=32:ngpus=4:mpiprocs=4 -v SEQ=262144 jobs/pbs.sh
# Adapting it to a site: see jobs/README.md.
#PBS -N mpiattn
#PBS -l select=2:ncpus=32:ngpus=4:mpiprocs=4
#PBS -l walltime=00:30:00
#PBS -j oe
# (above: job name; 2 chunks (nodes) of 32 cores and 4 GPUs with 4 MPI ranks each, one GPU per
#  rank; 30 min limit; stdout and stderr joined into one file)
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

# ---------------------------------------------------------------- problem size
BATCH=${BATCH:-1}                      # B
HEADS=${HEADS:-8}                      # H query heads
KV_HEADS=${KV_HEADS:-8}                # Hkv key/value heads (H must be a multiple)
SEQ=${SEQ:-131072}                     # N = M tokens of the big run
DIM=${DIM:-64}                         # E = Ev features per head
DTYPE=${DTYPE:-float32}                # stored and compute dtype (float16, float32, float64)
CHECK_SEQ=${CHECK_SEQ:-8192}           # tokens of the verified run (the float64 reference is O(N^2))
SEED=${SEED:-0}                        # make-data seed: same data for any number of ranks
DEVICE=${DEVICE:-gpu}                  # gpu (one per rank; fail if absent), auto, or cpu (NumPy)

# ---------------------------------------------------------------- files
WORKDIR=${WORKDIR:-$PWD}               # a parallel file system directory every node sees
JOB=${PBS_JOBID:-local}                # job id, to keep runs apart
JOB=${JOB%%.*}                         # drop the server name from "1234.server"
INPUT="$WORKDIR/mpiattn-in-$JOB.h5"    # big input (written by make-data)
OUTPUT="$WORKDIR/mpiattn-out-$JOB.h5"  # big output: out, lse, dq, dk, dv
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
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}   # CPU threads per rank (cores per chunk / mpiprocs)
export HDF5_USE_FILE_LOCKING=FALSE     # Lustre/GPFS mounts without flock reject HDF5's file locks

# Say what runs where (lands at the top of the job's output file).
echo "mpiattn job $JOB: $NRANKS ranks on $NODES nodes ($PPN per node), N=$SEQ, output $OUTPUT"

# 1. What the job sees: versions, ranks per host, GPUs per rank, CUDA-aware decision, parallel HDF5.
"${MPIEXEC[@]}" "$PYTHON" -m mpiattn info

# 2. Input: every rank generates and writes only its own rows (deterministic for SEED).
"${MPIEXEC[@]}" "$PYTHON" -m mpiattn make-data "$INPUT" --batch "$BATCH" --heads "$HEADS" \
    --kv-heads "$KV_HEADS" --seq "$SEQ" --dim "$DIM" --dtype "$DTYPE" --with-dout --causal \
    --seed "$SEED" --force

# 3. The big run: forward + backward (the input has dout), causal, on the GPUs; timings printed.
"${MPIEXEC[@]}" "$PYTHON" -m mpiattn run "$INPUT" -o "$OUTPUT" --device "$DEVICE" --strategy auto --force

# 4. Check: make a smaller input that the float64 reference can handle (O(N^2) on rank 0) ...
"${MPIEXEC[@]}" "$PYTHON" -m mpiattn make-data "$CHECK_IN" --batch "$BATCH" --heads "$HEADS" \
    --kv-heads "$KV_HEADS" --seq "$CHECK_SEQ" --dim "$DIM" --dtype "$DTYPE" --with-dout --causal \
    --seed "$SEED" --force
# ... and run it with --check (gathers to rank 0, compares with float64 NumPy).
"${MPIEXEC[@]}" "$PYTHON" -m mpiattn run "$CHECK_IN" -o "$CHECK_OUT" --device "$DEVICE" --check --force

# 5. Tidy up the big input (comment out to keep it); the outputs stay.
rm -f "$INPUT"                         # -f: no error if it is already gone
# Where the results are.
echo "done: $OUTPUT (verified on N=$CHECK_SEQ: $CHECK_OUT)"
