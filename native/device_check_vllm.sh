#!/usr/bin/env bash
# vLLM + the eaas.vllm plugin on one GPU with two expert-server processes (docs/vllm.md, GPU).
# Opt-in step 4 of native/device_check.sh (EAAS_DEVICE_CHECK_VLLM=1), with its own budget
# (< 5 min): needs a vLLM GPU build on the machine, named by VLLM_GPU_PYTHON (a python whose
# environment imports vllm and sees CUDA); without one it says so and exits 0.
#   1. the plugin into that environment (this checkout, --no-deps, no build isolation: offline);
#   2. two `eaas expert-server --device cuda --listen cudaipc:...` processes for the tiny
#      DeepSeek-V3 (each hosts every expert: redundancy 2) and their routing table;
#   3. vLLM alone and vLLM + plugin (--enforce-eager: the MoE call is host I/O, see docs/vllm.md)
#      on the same prompt: greedy token ids must be equal; the plugin's /health and metrics.
# Usage: native/device_check_vllm.sh [OUT_DIR]
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT_DIR=${1:-${OUT:-./device_check_out}}/vllm
mkdir -p "$OUT_DIR"
VPY=${VLLM_GPU_PYTHON:-}
if [ -z "$VPY" ] || ! (cd / && "$VPY" -c "import torch, vllm; assert torch.cuda.is_available()") 2>/dev/null; then
    echo "== vLLM GPU check skipped: no VLLM_GPU_PYTHON with vLLM and CUDA on this machine"
    exit 0
fi
rc=0
echo "== 4.1 plugin into $VPY's environment"
(cd / && timeout 60 "$VPY" -m pip install -q --no-deps --no-build-isolation -e "$OLDPWD") || rc=1
echo "== 4.2 two expert servers (cudaipc) + routing table"
MODEL=$("$PY" -c "from eaas.runtime.models.tiny import default_model_dir; print(default_model_dir())")
TABLE="$OUT_DIR/routing-table.json"
pids=()
for i in 0 1; do
    "$PY" -m eaas expert-server --model "$MODEL" --server-id "gpu-$i" --device cuda \
        --listen "cudaipc:$OUT_DIR/gpu-$i.sock" --experts "$("$PY" - "$MODEL" <<'PYEOF'
import sys
from eaas.runtime.models.arch import read_model_info
from eaas.runtime.tables.expert_spec import format_expert_spec
info = read_model_info(sys.argv[1])
print(format_expert_spec([(l, e) for l in info.moe_layers for e in range(info.num_experts)]))
PYEOF
)" > "$OUT_DIR/server-$i.log" 2>&1 &
    pids+=($!)
done
"$PY" - "$MODEL" "$TABLE" "$OUT_DIR" <<'PYEOF' || rc=1
import sys
from eaas.runtime.models.arch import read_model_info
from eaas.runtime.tables.table import RoutingTable
info = read_model_info(sys.argv[1])
pairs = [(l, e) for l in info.moe_layers for e in range(info.num_experts)]
ids = ["gpu-0", "gpu-1"]
t = RoutingTable.from_assignment(
    {s: pairs for s in ids}, {s: f"cudaipc:{sys.argv[3]}/{s}.sock" for s in ids}, 1,
    num_experts=info.num_experts, layers=info.moe_layers)
open(sys.argv[2], "w").write(t.to_json())
PYEOF
run_vllm() {  # $1: tag, $2...: extra env; prints the greedy token ids
    local tag=$1 port=$((18500 + RANDOM % 1000)); shift
    env "$@" VLLM_MLA_DISABLE=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
        "$(dirname "$VPY")/vllm" serve "$MODEL" --served-model-name m --dtype float32 \
        --enforce-eager --max-model-len 512 --gpu-memory-utilization 0.3 --port "$port" \
        > "$OUT_DIR/vllm-$tag.log" 2>&1 &
    local vp=$!
    for _ in $(seq 1 240); do curl -sf "localhost:$port/health" >/dev/null && break; sleep 0.5; done
    curl -s "localhost:$port/v1/completions" -H 'content-type: application/json' \
        -d '{"model":"m","prompt":[5,17,42,99,3],"max_tokens":16,"temperature":0,"ignore_eos":true,"return_token_ids":true}' \
        | "$PY" -c "import json,sys; print(json.load(sys.stdin)['choices'][0]['token_ids'])" \
        | tee "$OUT_DIR/tokens-$tag.txt"
    [ "$tag" = eaas ] && curl -s "localhost:18499/health" | tee "$OUT_DIR/plugin-health.json" && echo
    kill "$vp"; wait "$vp" 2>/dev/null
}
echo "== 4.3 vLLM alone vs vLLM + plugin"
timeout 120 bash -c "$(declare -f run_vllm); MODEL='$MODEL' OUT_DIR='$OUT_DIR' VPY='$VPY' PY='$PY' run_vllm alone VLLM_PLUGINS=" || rc=1
timeout 120 bash -c "$(declare -f run_vllm); MODEL='$MODEL' OUT_DIR='$OUT_DIR' VPY='$VPY' PY='$PY' run_vllm eaas EAAS_ROUTING_TABLE='$TABLE' EAAS_HTTP_PORT=18499" || rc=1
kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null
if [ -s "$OUT_DIR/tokens-alone.txt" ] && cmp -s "$OUT_DIR/tokens-alone.txt" "$OUT_DIR/tokens-eaas.txt"; then
    echo "== vLLM + plugin tokens == vLLM alone"
else
    echo "== vLLM + plugin tokens differ from vLLM alone (or missing)"; rc=1
fi
echo "== device_check_vllm.sh exit $rc (outputs in $OUT_DIR)"
exit $rc
