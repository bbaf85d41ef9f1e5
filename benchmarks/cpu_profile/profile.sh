#!/bin/bash
# Issue 40's profile: times of the native and torch engines beside SDPA (P = 1, H = 1, E = 64,
# causal, one thread), then where the native engine's time goes (perf). Run on an idle machine:
#   bash benchmarks/cpu_profile/profile.sh OUTDIR [N]
set -eu
out=${1:?OUTDIR}; N=${2:-16384}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
export MPIATTN_PROFILE_N=$N OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
for dt in ${DTYPES-float32 bfloat16 float16}; do
  for what in fwd fwdbwd; do
    for engine in ${ENGINES:-sdpa native torch}; do
      MPIATTN_PROFILE_REPEAT=3 python "$here/workload.py" $dt $what $engine >> "$out/times.jsonl"
    done
  done
done
if command -v perf >/dev/null; then
  for dt in ${PROFILE_DTYPES-float32 bfloat16}; do
    for what in fwd fwdbwd; do
      # the imports and the warm-up call take under 5 s here; the 12 calls after them are profiled
      MPIATTN_PROFILE_REPEAT=12 perf record -q -D 5000 -F 999 -o "$out/perf-$dt-$what.data" \
        python "$here/workload.py" $dt $what native >/dev/null 2>&1
      perf report -i "$out/perf-$dt-$what.data" --stdio --sort dso,sym --no-children -q 2>/dev/null \
        | python "$here/categorize.py" | sed "s/^/{\"dtype\": \"$dt\", \"what\": \"$what\", \"profile\": /; s/\$/}/" >> "$out/profile.jsonl"
    done
  done
fi
