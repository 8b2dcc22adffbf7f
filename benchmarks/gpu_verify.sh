#!/usr/bin/env bash
# Second, short GPU call: verify the fixes of the first (benchmarks/gpu_session.sh) and rerun what failed there
# for the harness's reasons (subprocesses without the carried wheels, no pytest cache).
#   1. setup (gpu_setup.sh)   2. (background, cores 4-15) the test files that failed there + those not reached
#   3. which flex_attention compiles work on this GPU (dtype x head dim, dynamic shapes)   4. the CUDA tests
#   bash .gpu/gpu_verify.sh                     # on the device, BUDGET s in all
#   DRY=1 OUT=/tmp/v PY=.venv/bin/python FILES=tests/dllm/test_hub_models.py bash benchmarks/gpu_verify.sh
# Files back: session.log subset.log subset.xml gpu_tests.log
BUDGET=${BUDGET:-220}
source "$(dirname "$0")/gpu_setup.sh"
FILES=${FILES:-"tests/weight_sync/test_weight_sync_transports.py tests/weight_sync/test_weight_sync_faults.py tests/weight_sync/test_weight_sync_integrity.py
 tests/trainer/test_ranks.py tests/server/test_server_connections.py tests/trainer/test_trainer_crash.py tests/trainer/test_trainer_ranks_e2e.py
 tests/trainer/align/test_align_e2e.py tests/dllm/test_hub_models.py tests/dllm/test_qwen_tokenizer.py tests/trainer/test_value_model.py
 tests/dllm/test_dllm_flex.py tests/dllm/test_fused_layout.py"}
echo "== 2. subset in the background ($(left)s left)"
XDIST=()
$PY -c "import xdist" 2>/dev/null && XDIST=(-n 12)
OMP_NUM_THREADS=1 pin 4-15 timeout -s INT -k 15 $(($(left) - 20)) $PY -m pytest -q "${XDIST[@]}" -m "not gpu" \
    --timeout 170 --tb=short -rfE --durations=10 --junitxml="$OUT/subset.xml" $FILES >"$OUT/subset.log" 2>&1 &
SUB_PID=$!
if [ "$DRY" != 1 ]; then
    echo "== 3. flex_attention probe ($(left)s left)"
    pin 0-3 timeout 90 $PY - <<'EOF'
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

fn = torch.compile(flex_attention, dynamic=True)
for dtype in (torch.float32, torch.bfloat16):
    for d in (16, 64, 128):
        try:
            for L in (200, 700):
                q, k, v = (torch.randn(2, 4, L, d, device="cuda", dtype=dtype) for _ in range(3))
                m = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, L, L, device="cuda")
                out = fn(q, k, v, block_mask=m)
                ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                err = ((out - ref).float().norm() / ref.float().norm()).item()
            print(f"flex {dtype} head_dim {d}: OK (rel err {err:.1e})", flush=True)
        except Exception as e:
            print(f"flex {dtype} head_dim {d}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
EOF
    echo "rc=$?"
fi
echo "== 4. CUDA tests ($(left)s left)"
pin 0-3 timeout -s INT -k 10 100 $PY -m pytest -v -rfEs -p no:cacheprovider --timeout 90 -m gpu tests/dllm/test_dllm_step.py \
    tests/dllm/test_dllm_flex.py tests/dllm/test_fused_layout.py >"$OUT/gpu_tests.log" 2>&1
echo "rc=$?"; grep -E "(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/gpu_tests.log" | grep -E "::|passed|failed" | tail -8
grep -E "^E  " "$OUT/gpu_tests.log" | head -6
echo "== waiting for the subset ($(left)s left)"
wait $SUB_PID
echo "subset rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/subset.log" | tail -30
echo "== done ($(left)s left)"
