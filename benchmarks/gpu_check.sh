#!/usr/bin/env bash
# The prepared device check (issues #32, #31, #36), in one go on a machine with an NVIDIA GPU (the steps' timeouts sum to
# 590 s, plus the native build: pass GPU_CHECK_SKIP to leave steps out when the device minutes are short).
#
#   benchmarks/gpu_check.sh [OUT_DIR]
#
# 1. the CUDA tests (pytest over the files that have them, and the executor's sync and placement
#    tests, which run on the emulated device and on CUDA alike);
# 2. benchmarks/gpu_check.py --device cuda: greedy-token parity CPU vs GPU placement on tiny
#    models; host syncs per decode step, counted by the device and by torch's sync debug mode;
# 3. benchmarks/gpu_real_shape.py: the Qwen3-30B-A3B-shaped model (48 layers) built in memory:
#    decode by VRAM cap and placement, syncs, prefill 4k/16k double-buffered vs on demand, a
#    cache resize under NVML pressure.
# 4. benchmarks/bench_recurrent_prefill.py --device cuda (Mamba-2, KDA): chunked prefill of 4k tokens vs the layer
#    once per token (issue #36's 20x), short (30 s each).
# 5. benchmarks/gpu_real_shape.py --experts-dtype ggml-q4_k_m (12 layers, decode at a 4 GiB cap): a Q4_K_M file's
#    experts kept as stored in the device slots, the CUDA kernels of native/ggml_rows.cu (issue #31 item 3).
# Reports land in OUT_DIR (default /tmp/moed-gpu-check). $PY picks the python (default: .venv's
# where it exists, else python3). On a machine without network, wheels of the packages its python
# lacks can be carried in .whl/ (docs/benchmarks.md says which); they are installed to /tmp/site.
# $GPU_CHECK_SKIP (comma-separated: tests,check,real,recurrent,ggml) leaves steps out; $TEST_FILES replaces the test list;
# $REAL_ARGS adds arguments to gpu_real_shape.py (e.g. --sections parity).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/moed-gpu-check}
mkdir -p "$OUT"
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
SKIP=",${GPU_CHECK_SKIP:-},"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! $PY -c "import moed" 2>/dev/null; then
  # this checkout without installing it: the package is daemon/, imported as moed
  mkdir -p /tmp/moed-src && ln -sfn "$PWD/daemon" /tmp/moed-src/moed
  export PYTHONPATH=/tmp/moed-src${PYTHONPATH:+:$PYTHONPATH}
  start=$(date +%s)
  if $PY setup.py -q build_ext --inplace > "$OUT/native_build.txt" 2>&1; then
    echo "native CPU kernels built in $(( $(date +%s) - start )) s"
  else
    echo "native CPU kernels not built (see native_build.txt): numba runs the CPU branch"; tail -5 "$OUT/native_build.txt"
  fi
fi
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv \
  | tee "$OUT/gpu.txt" || status=1
$PY -c "import torch, numba, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'numba', numba.__version__)"
if [[ $SKIP != *,tests,* ]]; then
  TEST_FILES=${TEST_FILES:-tests/devices tests/engine/test_device_hygiene.py tests/experts/test_device_syncs.py \
    tests/experts/test_ggml_slots.py tests/experts/test_prefill_stream.py tests/experts/test_placement_invariance.py}
  timeout 110 $PY -m pytest -q -p no:cacheprovider --tb=short $TEST_FILES > "$OUT/tests.txt" 2>&1 || status=1
  tail -25 "$OUT/tests.txt"
fi
if [[ $SKIP != *,check,* ]]; then
  timeout 100 $PY benchmarks/gpu_check.py --device cuda --skip decode --work /tmp/moed-gpu-work > "$OUT/check.md" 2>&1 \
    || status=1
  tail -40 "$OUT/check.md"
fi
if [[ $SKIP != *,real,* ]]; then
  timeout 240 $PY benchmarks/gpu_real_shape.py --device cuda --json "$OUT/real_shape.json" ${REAL_ARGS:-} \
    > "$OUT/real_shape.md" 2>&1 || status=1
  tail -60 "$OUT/real_shape.md"
fi
if [[ $SKIP != *,recurrent,* ]]; then
  for layer in mamba2 kda; do
    timeout 30 $PY benchmarks/bench_recurrent_prefill.py --layer $layer --device cuda --reference-tokens 256 \
      --json "$OUT/recurrent_$layer.json" > "$OUT/recurrent_$layer.txt" 2>&1 || status=1
    tail -20 "$OUT/recurrent_$layer.txt"
  done
fi
if [[ $SKIP != *,ggml,* ]]; then
  timeout 80 $PY benchmarks/gpu_real_shape.py --device cuda --experts-dtype ggml-q4_k_m --layers 12 --caps 4 --tokens 16 \
    --sections decode --json "$OUT/ggml_q4_k_m.json" > "$OUT/ggml_q4_k_m.md" 2>&1 || status=1
  tail -20 "$OUT/ggml_q4_k_m.md"
fi
exit $status
