#!/usr/bin/env bash
# One GPU check session on a lent CUDA machine (no network there), everything under $OUT early:
#   1. install carried wheels (.whl/*.whl: what the machine's image lacks) into /tmp/site, versions, nvidia-smi
#   2. the CUDA-marked tests (tests/dllm/test_dllm_step.py, test_dllm_flex.py, test_fused_layout.py,
#      tests/weight_sync/test_weight_sync_cuda_ipc.py) on CUDA
#   3. decode at the SDAR-1.7B shape, random bf16: eager vs CUDA graphs (+ kernels per step), then the
#      CUDA-IPC weight push of that model (4.1 GB bf16, benchmarks/sync.py; into session.log), then
#      3c the sampler compiled at 151,936 tokens (dynamic and static rows), 3d the replay training micro-step
#      at the SDAR-1.7B shape (eager / compiled / + checkpointing over bucketed lengths: tokens/s, peak memory,
#      recompiles), 3e the KV admission benchmark (CPU-side, tiny model), 3f the decode step compiled per
#      bucket with static shapes, alone and captured as CUDA graphs (attention: flash-attn if installed,
#      else SDPA), with whatever time is left (benchmarks/gpu_checks.py, kv_admission.py, decode_device.py)
#   4. (started first, in the background) the whole suite minus the gpu-marked tests of step 2, under xdist,
#      pinned to cores 4-15 (steps 2-3 to 0-3), junit xml; SIGINT (reports still written) before the budget ends
#
#   bash .gpu/gpu_session.sh                           # on the device (a copy of this file; BUDGET s in all)
#       .gpu/overlay/ (optional): files copied over the checkout first (a branch's changes; run sends main)
#   DRY=1 OUT=/tmp/gpu-dry PY=.venv/bin/python SUITE="tests/dlrl/test_cli_help.py" bash benchmarks/gpu_session.sh
#   DRY_RUN=1 ... the same (either name)
#
# DRY=1: this CPU box -- wheels into a temp dir, the same steps at tiny size on CPU, the suite subset $SUITE.
# Wheels: flash-attn is on PyPI only as a source distribution (2.8.3.post2, checked 2026-11-28: no binary
# wheel for any torch / CUDA); the device cannot build it (no network, hours of nvcc), so step 3f uses
# flash-attn only where the image has it, SDPA otherwise (the decode log says which).
# Files back (8 at most): session.log gpu_tests.log decode.json decode.kernels-eager.txt
# decode.kernels-graphs.txt compile.log suite.log suite.xml
BUDGET=${BUDGET:-570}
DRY=${DRY:-${DRY_RUN:-0}}
source "$(dirname "$0")/gpu_setup.sh"
echo "== 4. full suite in the background (first: the longest step) ($(left)s left)"
SUITE=${SUITE:-tests}
SUITE_T=$(($(left) - 25))
XDIST=()
$PY -c "import xdist" 2>/dev/null && XDIST=(-n 8)
OMP_NUM_THREADS=2 pin 4-15 timeout -s INT -k 20 $SUITE_T $PY -m pytest -q "${XDIST[@]}" -m "not gpu" --timeout 180 \
    --tb=short -rfE --durations=15 --junitxml="$OUT/suite.xml" $SUITE >"$OUT/suite.log" 2>&1 &
SUITE_PID=$!

echo "== 2. CUDA tests ($(left)s left)"  # their files' other tests run in the suite (step 4)
pin 0-3 timeout -s INT -k 10 200 $PY -m pytest -v -rfEs -p no:cacheprovider --timeout 150 -m gpu tests/dllm/test_dllm_step.py \
    tests/dllm/test_dllm_flex.py tests/dllm/test_fused_layout.py tests/weight_sync/test_weight_sync_cuda_ipc.py \
    tests/dllm/test_static_compile.py \
    >"$OUT/gpu_tests.log" 2>&1
echo "rc=$?"; grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/gpu_tests.log" | grep -E "gpu|cuda|passed|failed|ERROR" | tail -15

echo "== 3. decode benchmark, SDAR-1.7B shape ($(left)s left; suite running on other cores)"
if [ "$DRY" = 1 ]; then
    SMALL=(--layers 1 --batches 1 2 --max-tokens 8 --repeats 1 --set hidden_size=256 intermediate_size=512
           vocab_size=4096 num_attention_heads=4 num_key_value_heads=2 head_dim=64 mask_token_id=4000)
    pin 0-3 timeout 300 $PY benchmarks/decode.py --device cpu "${SMALL[@]}" --modes eager --profile --json "$OUT/decode.json"
    echo "rc=$?"
    echo "== 3b. weight push (cuda_ipc's CPU kind vs shm, 10m) ($(left)s left)"
    pin 0-3 timeout 200 $PY benchmarks/sync.py --sizes 10m --transports cuda_ipc,shm --pushes 2 --skip-checkpoint
    echo "rc=$?"
    echo "== 3c. sampler compiled at SDAR's vocabulary, CPU ($(left)s left)"
    pin 0-3 timeout 300 $PY benchmarks/gpu_checks.py sampler --device cpu --rows 2
    echo "rc=$?"
    echo "== 3d. replay micro-step, tiny, CPU ($(left)s left)"
    pin 0-3 timeout 300 $PY benchmarks/gpu_checks.py train --device cpu --shape tiny --dtype float32 --rows 4 \
        --lengths 24 40 72 30
    echo "rc=$?"
    echo "== 3e. KV admission ($(left)s left)"
    pin 0-3 timeout 200 $PY benchmarks/kv_admission.py --requests 16
    echo "rc=$?"
    echo "== 3f. decode step compiled per bucket ($(left)s left)"
    pin 0-3 timeout 300 $PY benchmarks/decode_device.py --device cpu "${SMALL[@]}" --modes compile \
        --strategies static >"$OUT/compile.log" 2>&1
    echo "rc=$?"; tail -4 "$OUT/compile.log"
else
    pin 0-3 timeout 200 $PY benchmarks/decode.py --device cuda --repeats 2 --profile --json "$OUT/decode.json"
    echo "rc=$?"
    echo "== 3b. CUDA-IPC weight push, SDAR-1.7B shape, 4.1 GB bf16, vs shm ($(left)s left)"
    pin 0-3 timeout 150 $PY benchmarks/sync.py --device cuda --sizes 1.7b --transports cuda_ipc,shm --dtype bfloat16 \
        --pushes 4 --skip-checkpoint
    echo "rc=$?"
    echo "== 3c. sampler compiled at SDAR's vocabulary (Triton) ($(left)s left)"
    pin 0-3 timeout 120 $PY benchmarks/gpu_checks.py sampler --device cuda --rows 1 8
    echo "rc=$?"
    echo "== 3d. replay micro-step, SDAR-1.7B shape, bf16, 32 rows, bucketed lengths ($(left)s left)"
    pin 0-3 timeout 150 $PY benchmarks/gpu_checks.py train --device cuda --shape sdar-1.7b --dtype bfloat16 --rows 32
    echo "rc=$?"
    echo "== 3e. KV admission, reserve vs optimistic (tiny model, CPU side) ($(left)s left)"
    pin 0-3 timeout 60 $PY benchmarks/kv_admission.py
    echo "rc=$?"
    CT=$(($(left) - 45))
    if [ "$CT" -gt 60 ]; then  # per-bucket static compiles of the 28-layer step: minutes; last, with what is left
        echo "== 3f. decode step compiled per bucket, alone and as CUDA graphs (${CT}s)"
        $PY -c "import flash_attn" 2>/dev/null && echo "flash-attn installed: decode attention = flash" \
            || echo "no flash-attn: decode attention = SDPA"
        pin 0-3 timeout $CT $PY benchmarks/decode_device.py --device cuda --modes compile-graphs compile --batches 1 128 \
            --max-tokens 16 --strategies static --repeats 2 >"$OUT/compile.log" 2>&1
        echo "compile rc=$?"; tail -8 "$OUT/compile.log"
    else
        echo "compile skipped: ${CT}s left for it"
    fi
fi

echo "== waiting for the suite ($(left)s left)"
wait $SUITE_PID
echo "suite rc=$?"
tail -40 "$OUT/suite.log"
$PY - "$OUT/suite.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception as e:
    sys.exit(f"no junit xml: {e!r}")
cases = root.iter("testcase")
bad = [(c.get("classname"), c.get("name"), k.tag, (k.get("message") or "")[:150]) for c in cases for k in c
       if k.tag in ("failure", "error")]
suite = root if root.tag == "testsuite" else root.find("testsuite")
print({k: suite.get(k) for k in ("tests", "failures", "errors", "skipped", "time")})
for b in bad:
    print(" | ".join(b))
EOF
echo "== done ($(left)s left)"
