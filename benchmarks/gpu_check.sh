#!/usr/bin/env bash
# GPU check: one command for a machine with a CUDA GPU (Python 3.12, torch with
# CUDA, numba-cuda; no DGL, no network).  Each step has its own time limit (the
# sum of all limits is over 8 minutes: in a short GPU session, name the steps):
#   tests     the CUDA tests (tests/test_cuda.py; the kernel tests on the real GPU;
#             tests/test_heterogeneous.py: per-node-type tables; no process-wide side
#             effects of the kernels under this NumPy: tests/test_import_side_effects.py)
#   reliability  the reliability suite's GPU cases (tests/test_reliability*.py -m cuda):
#             exactly-once in order, hash / torch.cuda._sleep / hash in every gather
#             mode, early exit, consumer failure, bad ids, 100-lifecycle leaks
#   ddp       two torch.distributed (gloo) ranks on the one GPU, each page-locking the
#             parent's shared-memory table for its zero-copy gather (tests/test_distributed.py)
#   memcheck  compute-sanitizer memcheck on a small workload (if the tool works here)
#   memcheck-reliability  memcheck on the out-of-range and leak tests of that suite
#   gather    benchmarks/gather.py --device cuda (zero-copy vs staged vs pinned
#             index_select vs pinned memcpy vs device-resident)
#   epochs    GraphSAGE with the built-in sampler: the plain loop and each gather mode
# Usage: benchmarks/gpu_check.sh OUTDIR [STEP...]   (default: all steps)
# In a 15-minute device session, run the correctness steps in one call:
#   benchmarks/gpu_check.sh OUT tests reliability memcheck-reliability   (limits: 8.5 min)
# and `ddp` (limit 1.5 min) if the session has the time.
# Writes at most 7 files: machine.txt, log.txt, epochs.json, epochs-large.json,
# gather-cuda.{json,md,png}.
set -u
out=${1:?usage: benchmarks/gpu_check.sh OUTDIR [STEP...]}
shift
steps=${*:-tests reliability ddp memcheck memcheck-reliability gather epochs epochs-large}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
log=$out/log.txt
status=0
run() {  # run NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  echo "--- $name rc=$rc" | tee -a "$log"
  [ $rc -eq 0 ] || status=1
}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv
  nproc; free -g | head -2
  $py -c "import torch, numba, numpy; from numba import cuda; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'numba', numba.__version__, 'numba-cuda', getattr(cuda, '__version__', '?'), 'numpy', numpy.__version__)"
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"
for step in $steps; do
  case $step in
    tests)
      run tests 150 $py -m pytest -q -p no:cacheprovider -W default \
        tests/test_cuda.py tests/test_kernels_cudasim.py tests/test_heterogeneous.py \
        tests/test_import_side_effects.py ;;
    reliability)
      run reliability 180 $py -m pytest -q -p no:cacheprovider -W default -m cuda \
        tests/test_reliability.py tests/test_reliability_lifecycle.py \
        tests/test_reliability_system.py ;;
    ddp)
      run ddp 90 $py -m pytest -q -p no:cacheprovider -W default -m cuda \
        tests/test_distributed.py ;;
    memcheck|memcheck-reliability)
      if ! command -v compute-sanitizer >/dev/null; then
        echo "compute-sanitizer not found: $step skipped" | tee -a "$log"
      elif [ "$step" = memcheck ]; then
        run memcheck 90 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 \
          $py benchmarks/gpu_sanitize.py
      else
        run memcheck-reliability 180 compute-sanitizer --tool memcheck --report-api-errors no \
          --error-exitcode 3 $py -m pytest -q -p no:cacheprovider -W default -m cuda \
          -k "bad_ids or leak" tests/test_reliability_system.py
      fi ;;
    gather)
      run gather 180 $py benchmarks/gather.py --device cuda --table-gib 4 \
        --row-bytes 128 512 2048 --dtypes float32 --rounds 5 --out "$out" ;;
    epochs|epochs-large)
      # epochs: the example's default graph; epochs-large: 500k nodes x 256 features
      # (a 0.5 GB table, ~100k rows per batch) so that gathering matters.
      size=(); n_epochs=3
      [ "$step" = epochs-large ] && size=(--num-nodes 500000 --feat-dim 256 --fanouts 10,10) && n_epochs=2
      tmp=$(mktemp -d)
      run "$step-plain" 90 $py examples/train_sage.py --device cuda --sampler builtin \
        --loader dgl --epochs "$n_epochs" "${size[@]}" --json "$tmp/plain.json"
      for mode in zerocopy zerocopy-sorted staged device; do
        extra=(--gather "${mode%-sorted}")
        [ "$mode" = zerocopy-sorted ] && extra+=(--sort-ids)
        run "$step-$mode" 90 $py examples/train_sage.py --device cuda --sampler builtin \
          "${extra[@]}" --epochs "$n_epochs" "${size[@]}" --json "$tmp/$mode.json"
      done
      $py - "$tmp" "$out/$step.json" <<'PY'
import json, pathlib, sys
runs = {p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json"))}
pathlib.Path(sys.argv[2]).write_text(json.dumps(runs, indent=1))
for name, r in runs.items():
    print(name, "epoch_times", [round(t, 3) for t in r.get("epoch_times", [])], "test_acc", r.get("test_acc"))
PY
      ;;
    *) echo "unknown step $step"; status=1 ;;
  esac
done
echo "gpu_check finished with status $status" | tee -a "$log"
exit $status
