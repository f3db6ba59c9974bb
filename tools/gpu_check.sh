#!/usr/bin/env bash
# GPU validation, for a machine with CUDA: builds the CUDA extension in place, checks that it can
# raise an error message (a miscompiled one crashes there), runs the CUDA test grid (kernels,
# opcheck; and the argument fuzzing, where CUDA devices are valid input), the distributed
# CUDA/NCCL checks (tools/gpu_check.py), the kernel benchmark and hetlb's per-step cost on CUDA
# (bench/bench_gpu_overhead.py; GPU_CHECK_TRACE=DIR adds profiler traces) and recomputation against
# plain micro-steps (bench/bench_recompute.py), then prints one summary.
# Without a CUDA device it says so and exits 0 (CI runs it). Uses $PYTHON, else `python`, else
# `python3`.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-$(command -v python || command -v python3)}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" 2>/dev/null; then
  echo "gpu_check: no CUDA device ($("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1)): nothing to check"
  exit 0
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The system compiler unless CXX says otherwise: on the first GPU image tried, the default g++ on
# PATH (a wrapper in /opt/gcc) built an extension that crashed printing its first error message.
if [ -z "${CXX:-}" ] && [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++ CC=${CC:-/usr/bin/gcc}; fi
declare -A result
step() {  # step NAME COMMAND...
  local name=$1; shift
  echo "=== $name: $*"
  if "$@"; then result[$name]=PASS; else result[$name]="FAIL (exit $?)"; fi
}
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
step build env HETLB_FORCE_CUDA=1 "$PY" setup.py build_ext --inplace
step extension "$PY" -c "import hetlb; assert hetlb._C.has_cuda, 'CUDA kernels not built'; print('hetlb._C.has_cuda', hetlb._C.has_cuda)"
step error_message "$PY" -c "
import torch
from hetlb import ops
try:
    ops.scale_([torch.zeros(2), torch.zeros(3, dtype=torch.float64)], 1.0)
except RuntimeError as e:
    assert 'tensors[1] is Double[3]' in str(e), e
    print('error messages format:', str(e).splitlines()[0][:80])
else:
    raise SystemExit('no error for mixed dtypes')"
step cuda_tests "$PY" -m pytest tests/test_ops.py tests/test_profile.py tests/test_bad_input.py -q -p no:cacheprovider -x \
  -o addopts="-ra --benchmark-disable --timeout=600"  # (one process; the image may lack pytest-xdist)
step gpu_checks "$PY" tools/gpu_check.py
step bench_kernels "$PY" bench/bench_kernels.py --device cuda
# hetlb's per-step cost on one GPU, step-interleaved (one step of each variant in turn, each between
# synchronisations: the full cost, nothing hidden), with the main-thread loader and with 2 loader
# workers: the default (Uniform exchanges its table in adaptive blocks) against a table every step.
# ${GPU_CHECK_TRACE:+...}: a directory for torch.profiler traces of each variant.
step gpu_overhead "$PY" bench/bench_gpu_overhead.py --interleave step --variants plain plain#2 default default/1 \
  --rounds 3 --steps 100 ${GPU_CHECK_TRACE:+--trace "$GPU_CHECK_TRACE"}
step gpu_overhead_workers "$PY" bench/bench_gpu_overhead.py --interleave step --workers 2 \
  --variants plain plain#2 default default/1 --rounds 3 --steps 100
# Per-rank recomputation against plain micro-steps on one GPU (bench/RESULTS.md 15.4 is the CPU's).
step bench_recompute "$PY" bench/bench_recompute.py --device cuda --seq 256 --budget-mb 512 \
  --shares 32,64,128,256 --rounds 5
echo "=== gpu_check summary"
failed=0
for name in build extension error_message cuda_tests gpu_checks bench_kernels gpu_overhead gpu_overhead_workers \
    bench_recompute; do
  printf '%-14s %s\n' "$name" "${result[$name]:-not run}"
  [ "${result[$name]:-}" = PASS ] || failed=1
done
exit $failed
