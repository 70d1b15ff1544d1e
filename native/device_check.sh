#!/usr/bin/env bash
# One-GPU check of the EaaS GPU data plane. Runs in < 5 min on one H200:
#   1. NVRTC build of every native/ kernel for this GPU's arch and for sm_90 + sm_100;
#   2. pytest -m gpu tests/gpu (the GPU-only tests; every test of tests/gpu carries the tier
#      marker gpu_cpu and runs in CI on the CPU, so it is not repeated here). GPU-only: kernels + graph capture, cudaipc with a CUDA payload (module and
#      `eaas expert-server --device cuda`, a cpu server refusing it), CUDA-graph round trips,
#      device-aware dispatcher staging, one CUDA stream per overlap micro-batch (toy stack and
#      the engine);
#   3. python -m eaas.native.device_check: the table (kernel correctness, grouped GEMM
#      time with 1/8/32 of 256 experts active, cudaipc round trip B=1/64/256 vs a device copy
#      and DeepEP's published figures, CUDA-graph replay of a decode step's real MoE round trip
#      over cudaipc vs eager send/recv);
#   4. opt-in (EAAS_DEVICE_CHECK_VLLM=1, its own < 5 min budget): native/device_check_vllm.sh,
#      vLLM + the eaas.vllm plugin on this GPU with two expert-server processes (needs a vLLM
#      GPU build named by VLLM_GPU_PYTHON; docs/vllm.md).
# Usage: native/device_check.sh [OUT_DIR]   (default: $OUT if set, else ./device_check_out)
# Exit status: 0 when every step passed.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT_DIR=${1:-${OUT:-./device_check_out}}
mkdir -p "$OUT_DIR"
export EAAS_CACHE_DIR=${EAAS_CACHE_DIR:-$OUT_DIR/cache}
rc=0
echo "== nvidia-smi"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
echo "== 1. NVRTC build"
timeout 60 "$PY" -m eaas.runtime.cuda.nvrtc sm_90 sm_100 2>&1 | tee "$OUT_DIR/build.txt" || rc=1
echo "== 2. pytest tests/gpu"
timeout 95 "$PY" -m pytest tests/gpu -q -p no:cacheprovider -n 0 -m gpu -rs \
  2>&1 | tee "$OUT_DIR/pytest.txt" | tail -30
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
echo "== 3. device table"
timeout 140 "$PY" -m eaas.native.device_check --out "$OUT_DIR/device_table.md" || rc=1
if [ "${EAAS_DEVICE_CHECK_VLLM:-0}" = 1 ]; then
    echo "== 4. vLLM + eaas.vllm plugin"
    bash native/device_check_vllm.sh "$OUT_DIR" || rc=1
fi
echo "== device_check.sh exit $rc (outputs in $OUT_DIR)"
exit $rc
