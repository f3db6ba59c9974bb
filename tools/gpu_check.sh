#!/usr/bin/env bash
# GPU validation, for a machine with CUDA: builds the CUDA extension in place, runs the CUDA test
# grid (kernels, opcheck), the distributed CUDA/NCCL checks (tools/gpu_check.py), and the kernel
# benchmark on CUDA, then prints one summary. Without a CUDA device it says so and exits 0 (CI
# runs it). Uses $PYTHON, else `python`, else `python3`.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-$(command -v python || command -v python3)}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" 2>/dev/null; then
  echo "gpu_check: no CUDA device ($("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1)): nothing to check"
  exit 0
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
declare -A result
step() {  # step NAME COMMAND...
  local name=$1; shift
  echo "=== $name: $*"
  if "$@"; then result[$name]=PASS; else result[$name]="FAIL (exit $?)"; fi
}
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
step build env HETLB_FORCE_CUDA=1 "$PY" setup.py build_ext --inplace
step extension "$PY" -c "import hetlb; assert hetlb._C.has_cuda, 'CUDA kernels not built'; print('hetlb._C.has_cuda', hetlb._C.has_cuda)"
step cuda_tests "$PY" -m pytest tests/test_ops.py tests/test_profile.py -q -p no:cacheprovider -x
step gpu_checks "$PY" tools/gpu_check.py
step bench_kernels "$PY" bench/bench_kernels.py --device cuda
echo "=== gpu_check summary"
failed=0
for name in build extension cuda_tests gpu_checks bench_kernels; do
  printf '%-14s %s\n' "$name" "${result[$name]:-not run}"
  [ "${result[$name]:-}" = PASS ] || failed=1
done
exit $failed
