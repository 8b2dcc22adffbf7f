#!/usr/bin/env bash
# The LMDeploy device check, in one go under 10 minutes on a lent CUDA machine (no network there):
#   1. the kits: .whl (benchmarks/device_kit.sh: dlrl's deps) into /tmp/site, .lmdkit (benchmarks/lmdeploy_kit.sh)
#      into /tmp/lmdsite, both on PYTHONPATH; versions, nvidia-smi
#   2. the GPU test of server.backend=lmdeploy (tests/server/test_lmdeploy_gpu.py: serve, push into the uni
#      executor's model agent, close releases the executor, fresh engine) and the LMDeploy runner's CPU tests
#      (the same adapter against LMDeploy's double; with lmdeploy importable, the weight handoff through
#      lmdeploy's own BaseModelAgent.update_params too)
#   3. benchmarks/lmdeploy_vs_native.py at the SDAR-1.7B shape (28 layers, bf16), batch 1 / 32 / 128, static and
#      dynamic, native (CUDA graphs) vs LMDeploy: the table into $OUT/compare.md, rows into $OUT/compare.json
#
#   run(carry=[".whl", ".lmdkit"], command="OUT=$OUT bash benchmarks/lmdeploy_device.sh", timeout_s=590)
#   DRY=1 OUT=/tmp/lmd-dry PY=.venv/bin/python bash benchmarks/lmdeploy_device.sh     # this CPU box: --dry-run
# Files back: lmdeploy.log (everything), tests.log, compare.md, compare.json.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/lmdeploy-device}
PY=${PY:-python3}
BUDGET=${BUDGET:-570}
START=$(date +%s)
mkdir -p "$OUT"
exec > >(tee -a "$OUT/lmdeploy.log") 2>&1
left() { echo $((BUDGET - ($(date +%s) - START))); }

echo "== 1. kits ($(left)s left)"
if [ -z "${DRY:-}" ]; then
    [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD  # dlrl's wheels (pydantic, ...) before the kit's import check
    # shellcheck source=/dev/null
    source benchmarks/lmdeploy_kit_setup.sh
    export PYTHONPATH=/tmp/lmdsite:/tmp/site:$PWD
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
else
    export PYTHONPATH=$PWD
fi
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"

echo "== 2. tests ($(left)s left)"
timeout -s INT -k 10 $(( $(left) > 400 ? 200 : $(left) / 2 )) "$PY" -m pytest -v -rfEs -p no:cacheprovider \
    tests/server/test_lmdeploy_gpu.py tests/server/test_lmdeploy_backend.py tests/server/test_lmdeploy_params.py \
    >"$OUT/tests.log" 2>&1
echo "tests: exit $? (tests.log)"; tail -5 "$OUT/tests.log"

echo "== 3. native vs LMDeploy ($(left)s left)"
ARGS=(--json "$OUT/compare.json" --max-tokens 128)
[ -n "${DRY:-}" ] && ARGS+=(--dry-run)
timeout -s INT -k 10 $(( $(left) - 10 )) "$PY" benchmarks/lmdeploy_vs_native.py "${ARGS[@]}" | tee "$OUT/compare.md"
echo "compare: exit ${PIPESTATUS[0]} ($(left)s left)"
