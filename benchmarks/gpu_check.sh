#!/usr/bin/env bash
# GPU check: one command for a machine with a CUDA GPU (Python 3.12, torch with
# CUDA, numba-cuda; no DGL, no network).  Each step runs under its own time limit
# (seconds, in brackets).
#
# The default steps (no STEP given) -- limits 8.6 minutes in all; a normal run
# takes about 5 -- are what docs/benchmarks/gpu-latest.json reports:
#   tests [120]    the CUDA tests: tests/test_cuda.py, the kernel tests on the real GPU
#                  (test_kernels_cudasim.py, test_sorted_gather_cudasim.py, the cache's
#                  hit-and-miss gather test_cached_gather_cudasim.py), per-node-type
#                  tables (test_heterogeneous.py), auto's choice (test_gather_choice.py),
#                  the CUDA warm-ups (test_warmup.py's cuda cases), no process-wide side
#                  effects (test_import_side_effects.py)
#   memcheck [75]  compute-sanitizer memcheck on a small workload (if the tool works here)
#   gather [100]   benchmarks/gather.py --device cuda: a 4 GiB float32 table on 4 KiB and on
#                  2 MiB pages; random, address-ordered and GPU-sorted ids; 128/512/2048 B
#                  rows; 5 rounds; the sort sweep (1k..1M ids per call, 512 B rows)
#   epochs [70+3x50]  GraphSAGE with the built-in sampler where the gather matters (500k
#                  nodes x 256 float32 features = 0.5 GB, fanouts 10,10: the plain loop was
#                  2.9x slower than device-resident at 0acc300): plain, zerocopy, staged,
#                  device; each a fresh process, 1 warm-up + 3 timed epochs
# More steps, by name (keep each call under 10 minutes of limits):
#   reliability [180]  the reliability suite's GPU cases (tests/test_reliability*.py -m cuda),
#                  and row sources on the GPU, local rows included (test_rowsource.py,
#                  test_local_rows.py -m cuda: each gather mode)
#   ddp [90]       two gloo ranks on the one GPU, zero-copy from shared memory
#   dist [2x150]   examples/train_dist.py --device cuda: DistDGL on 127.0.0.1 (2 partitions,
#                  2 servers, 2 gloo trainers on the one GPU), DistTensor rows through
#                  pingpong's staging buffers, then the plain loop; 2 epochs each (needs
#                  DGL: PINGPONG_DGL_WHEEL)
#   memcheck-reliability [180]  memcheck on the out-of-range and leak tests of that suite
#   gather-32g [300]  gather.py with a 32 GiB table (4 KiB and 2 MiB pages; skipped when
#                  RAM is short), 512 B rows, no sweep: JSON only
#   epochs-nosort [50]  the epochs configuration, zerocopy with --sort-ids none (added
#                  to epochs.json)
#   epochs-small [4x60]  the example's default graph (epochs-small.json)
#   cache [3x50]   the epochs configuration (power-law graph): zerocopy without and with
#                  a hot-row cache of 10% of the table (--cache-bytes 51200000, learned in
#                  epoch 1), and device-resident (epochs-cache.json; cache stats in "stats")
# Correctness in one short session:  benchmarks/gpu_check.sh OUT tests reliability memcheck-reliability
# With DGL (its tests on the GPU: DGL graphs as EdgeBlocks / HeteroEdgeBlocks):
#   PINGPONG_DGL_WHEEL=.whl/dgl-1.1.3-cp311-cp311-manylinux1_x86_64.whl benchmarks/gpu_check.sh OUT ...
#
# After the steps, always: benchmarks/gpu_latest.py writes OUT/gpu-latest.json from
# log.txt, machine.txt and the JSON files above, and copies it to
# docs/benchmarks/gpu-latest.json (not when machine.txt names no GPU: a dry run on a
# CPU never replaces the record).  The commit recorded is `git rev-parse HEAD` here, or
# $PINGPONG_COMMIT when this copy has no .git (give it on the command line:
# PINGPONG_COMMIT=<sha> bash benchmarks/gpu_check.sh OUT), with source_sha256 of the
# sources (`python benchmarks/gpu_latest.py --source-hash` prints a tree's).
# Usage: benchmarks/gpu_check.sh OUTDIR [STEP...]
# Writes at most 10 files to OUTDIR: machine.txt, log.txt, gather-cuda.{json,md,png},
# gather-cuda-32g.json, epochs.json, epochs-cache.json, gpu-latest.json
# (epochs-small.json if named).
set -u
out=${1:?usage: benchmarks/gpu_check.sh OUTDIR [STEP...]}
shift
given_steps="$*"
steps=${given_steps:-tests memcheck gather epochs}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
# DGL: the GPU machine has none and installs nothing.  PINGPONG_DGL_WHEEL names a
# carried PyPI DGL wheel (dgl-1.1.3-cp311-...-manylinux1_x86_64.whl, 6.5 MB) that
# is unpacked onto PYTHONPATH as it is: its Cython module is for CPython 3.11, so
# DGL falls back to its ctypes bindings, which ran DGL's sampling and the DGL tests
# on Python 3.12 + torch 2.11 + NumPy 2.5 on a CPU (all but ClusterGCN, whose DGL
# code calls np.cumsum on a tensor, which NumPy 2 refuses).
if [ -n "${PINGPONG_DGL_WHEEL:-}" ]; then
  dgl_site=$(mktemp -d)
  if $py -m zipfile -e "$PINGPONG_DGL_WHEEL" "$dgl_site"; then
    export PYTHONPATH=$PYTHONPATH:$dgl_site
  else
    echo "PINGPONG_DGL_WHEEL=$PINGPONG_DGL_WHEEL could not be unpacked" >&2; exit 2
  fi
fi
log=$out/log.txt
status=0
run() {  # run NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  echo "--- $name rc=$rc ($((SECONDS - start))s)" | tee -a "$log"
  [ $rc -eq 0 ] || status=1
}
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  $py benchmarks/gpu_latest.py --provenance
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv
  echo "cores: $(nproc)"; free -g | head -2
  echo "thp: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)"
  $py -c "import torch, numba, numpy; from numba import cuda; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'numba', numba.__version__, 'numba-cuda', getattr(cuda, '__version__', '?'), 'numpy', numpy.__version__)"
  $py -W ignore -c "import dgl; print('dgl', dgl.__version__, '(${PINGPONG_DGL_WHEEL:-installed})')" 2>/dev/null \
    || echo "dgl: none (the DGL tests skip)"
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

# epochs-like steps: run_epochs STEP JSON LIMIT_FIRST LIMIT_OTHERS FLAGS -- MODES...
run_epochs() {
  local step=$1 json=$2 first_limit=$3 limit=$4; shift 4
  local flags=()
  while [ "$1" != "--" ]; do flags+=("$1"); shift; done
  shift
  local tmp; tmp=$(mktemp -d)
  local warm=false
  ls pingpong/kernels/__pycache__/cuda._gather_kernel*.nbi >/dev/null 2>&1 && warm=true
  local mode
  for mode in "$@"; do
    local extra=() limit_now=$limit
    case $mode in
      plain) extra=(--loader dgl); limit_now=$first_limit ;;
      zerocopy-nosort) extra=(--gather zerocopy --sort-ids none) ;;
      zerocopy-cache) extra=(--gather zerocopy --cache-bytes "$cache_bytes") ;;
      *) extra=(--gather "$mode") ;;
    esac
    run "$step-$mode" "$limit_now" $py examples/train_sage.py --device cuda --sampler builtin \
      "${extra[@]}" "${flags[@]}" --json "$tmp/$mode.json"
  done
  $py - "$tmp" "$json" "${flags[*]}" "$warm" <<'PY'
import json, pathlib, sys
tmp, target, config, warm = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3], sys.argv[4]
payload = {"config": config, "runs": {}}
if target.exists():  # epochs-nosort adds to the epochs step's file (same configuration)
    old = json.loads(target.read_text())
    if old.get("config") == config:
        payload = old
payload.setdefault("numba_cache_warm_before", {})
for path in sorted(tmp.glob("*.json")):
    payload["runs"][path.stem] = json.loads(path.read_text())
    payload["numba_cache_warm_before"][path.stem] = warm == "true"
target.write_text(json.dumps(payload, indent=1))
for name, r in payload["runs"].items():
    print(name, "epoch_times", [round(t, 3) for t in r.get("epoch_times", [])], "test_acc", r.get("test_acc"))
PY
  rm -rf "$tmp"
}

large=(--num-nodes 500000 --feat-dim 256 --fanouts "10,10" --epochs 4)
cache_bytes=51200000  # 10% of the large configuration's 500k x 256 float32 table
for step in $steps; do
  case $step in
    tests)
      run tests 120 $py -m pytest -q -p no:cacheprovider -W default \
        tests/test_cuda.py tests/test_kernels_cudasim.py tests/test_sorted_gather_cudasim.py \
        tests/test_cached_gather_cudasim.py tests/test_heterogeneous.py tests/test_gather_choice.py tests/test_import_side_effects.py \
        tests/test_warmup.py::test_cuda_warm_up_compiles_what_the_gather_launches \
        tests/test_warmup.py::test_cuda_kernel_modes_warm_up_the_host_id_check_too ;;
    reliability)
      run reliability 180 $py -m pytest -q -p no:cacheprovider -W default -m cuda \
        tests/test_reliability.py tests/test_reliability_lifecycle.py \
        tests/test_reliability_system.py tests/test_rowsource.py tests/test_local_rows.py ;;
    ddp)
      run ddp 90 $py -m pytest -q -p no:cacheprovider -W default -m cuda \
        tests/test_distributed.py ;;
    dist)
      for loader in pingpong sync; do
        run "dist-$loader" 150 $py examples/train_dist.py --device cuda --loader "$loader" \
          --epochs 2 --job-timeout 140
      done ;;
    memcheck|memcheck-reliability)
      if ! command -v compute-sanitizer >/dev/null; then
        echo "=== $step skipped: compute-sanitizer not found" | tee -a "$log"
      elif [ "$step" = memcheck ]; then
        run memcheck 75 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 \
          $py benchmarks/gpu_sanitize.py
      else
        run memcheck-reliability 180 compute-sanitizer --tool memcheck --report-api-errors no \
          --error-exitcode 3 $py -m pytest -q -p no:cacheprovider -W default -m cuda \
          -k "bad_ids or leak" tests/test_reliability_system.py
      fi ;;
    gather)
      run gather 100 $py benchmarks/gather.py --device cuda --table-gib 4 --pages normal thp \
        --row-bytes 128 512 2048 --dtypes float32 --rounds 5 --out "$out" ;;
    gather-32g)
      run gather-32g 300 $py benchmarks/gather.py --device cuda --table-gib 32 --pages normal thp \
        --row-bytes 512 --dtypes float32 --rounds 5 --sweep-row-bytes 0 --formats json \
        --name gather-cuda-32g --out "$out" ;;
    epochs)
      run_epochs epochs "$out/epochs.json" 70 50 "${large[@]}" -- plain zerocopy staged device ;;
    epochs-nosort)
      run_epochs epochs "$out/epochs.json" 70 50 "${large[@]}" -- zerocopy-nosort ;;
    cache)
      run_epochs cache "$out/epochs-cache.json" 50 50 "${large[@]}" --graph-kind powerlaw -- \
        zerocopy zerocopy-cache device ;;
    epochs-small)
      run_epochs epochs-small "$out/epochs-small.json" 60 60 --epochs 4 -- plain zerocopy staged device ;;
    *) echo "=== $step skipped: unknown step" | tee -a "$log"; status=1 ;;
  esac
done
$py benchmarks/gpu_latest.py "$out" --command "bash benchmarks/gpu_check.sh OUT${given_steps:+ $given_steps}" \
  --copy-to docs/benchmarks/gpu-latest.json || status=1
echo "gpu_check finished with status $status" | tee -a "$log"
exit $status
