#!/usr/bin/env bash
# The prepared device check of issue #13, in one go on a machine with an NVIDIA GPU (<= 8 minutes).
#
#   benchmarks/gpu_check.sh [OUT_DIR]
#
# 1. the CUDA tests (pytest -m gpu over the files that have them, and the executor's sync and
#    placement tests, which run on the emulated device and on CUDA alike);
# 2. benchmarks/gpu_check.py --device cuda: greedy-token parity CPU vs GPU placement on tiny
#    models, host syncs per decode step, decode and prefill by policy at 25% / 50% of the pool.
# Reports land in OUT_DIR (default /tmp/moed-gpu-check). $PY picks the python (default: .venv's
# where it exists, else python3). On a machine without network, wheels of the packages its python
# lacks can be carried in .whl/ (docs/benchmarks.md says which); they are installed to /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/moed-gpu-check}
mkdir -p "$OUT"
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! $PY -c "import moed" 2>/dev/null; then
  # this checkout without installing it: the package is daemon/, imported as moed
  mkdir -p /tmp/moed-src && ln -sfn "$PWD/daemon" /tmp/moed-src/moed
  export PYTHONPATH=/tmp/moed-src${PYTHONPATH:+:$PYTHONPATH}
  $PY setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "native CPU kernels not built: numba runs the CPU branch"
fi
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt" || status=1
timeout 240 $PY -m pytest -q -p no:cacheprovider \
  tests/devices tests/engine/test_device_hygiene.py tests/experts/test_device_syncs.py tests/experts/test_prefill_stream.py \
  tests/experts/test_placement_invariance.py 2>&1 | tee "$OUT/tests.txt" || status=1
timeout 300 $PY benchmarks/gpu_check.py --device cuda --work /tmp/moed-gpu-work 2>&1 | tee "$OUT/report.md" || status=1
exit $status
