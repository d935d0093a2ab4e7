#!/usr/bin/env bash
# GPU check: one command for a machine with a CUDA GPU (Python 3.12, torch with
# CUDA, numba-cuda; no DGL, no network).  Runs, in order, each step bounded by
# its own timeout so the whole script stays under ~8 minutes:
#   1. the CUDA tests (tests/test_cuda.py, and the kernel tests on the real GPU)
#   2. compute-sanitizer memcheck on a small zero-copy workload (if available)
#   3. the gather benchmark on CUDA (zero-copy vs staged vs pinned index_select
#      vs pinned memcpy vs device-resident), JSON + Markdown
#   4. GraphSAGE epochs with the built-in sampler for each gather mode
# Usage: benchmarks/gpu_check.sh OUTDIR
set -u
out=${1:?usage: benchmarks/gpu_check.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
status=0
step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date -u +%H:%M:%S), limit ${limit}s)" | tee -a "$out/summary.txt"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 15 "$out/$name.log"
  echo "-- $name rc=$rc" | tee -a "$out/summary.txt"
  [ $rc -eq 0 ] || status=1
}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $py -c "import torch, numba, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'numba', numba.__version__, 'numpy', numpy.__version__)"
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"
step cuda-tests 180 $py -m pytest -q -p no:cacheprovider -o addopts="" -W ignore::DeprecationWarning \
  tests/test_cuda.py tests/test_kernels_cudasim.py
if command -v compute-sanitizer >/dev/null; then
  step memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 3 $py benchmarks/gpu_sanitize.py
else
  echo "compute-sanitizer not found: memcheck skipped" | tee -a "$out/summary.txt"
fi
step gather-bench 150 $py benchmarks/gather.py --device cuda --out "$out"
for mode in zerocopy staged device; do
  step "epoch-$mode" 60 $py examples/train_sage.py --device cuda --sampler builtin \
    --gather "$mode" --epochs 2 --json "$out/epoch-$mode.json"
done
echo "gpu_check finished with status $status" | tee -a "$out/summary.txt"
exit $status
