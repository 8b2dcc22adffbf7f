# Sourced by benchmarks/gpu_session.sh and gpu_verify.sh (copies in .gpu/ on the device): overlay, wheels,
# versions, helpers `left` and `pin`. Wheels go into /tmp/site, put first on sys.path by a .pth file in the
# device python's site-packages, so that subprocesses whose tests rebuild PYTHONPATH see them too.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
PY=${PY:-python3}
DRY=${DRY:-${DRY_RUN:-0}}
START=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - START))); }
pin() {  # pin CPUS CMD...: taskset where there is one
    local cpus=$1; shift
    if command -v taskset >/dev/null && [ "$(nproc)" -ge 8 ]; then taskset -c "$cpus" "$@"; else "$@"; fi
}
exec > >(tee -a "$OUT/session.log") 2>&1
if [ -d .gpu/overlay ]; then  # a branch's changed files over the lead's checkout (the device copy is disposable)
    cp -r .gpu/overlay/. .
    echo "overlay: $(cd .gpu/overlay && find . -type f | sort | tr '\n' ' ')"
fi
echo "== 1. setup $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null) dirty=$(git status --porcelain 2>/dev/null | grep -vc '^??')"
SITE=/tmp/site
PLAT=()
if [ "$DRY" = 1 ]; then  # unpack only (cp312 wheels for the device's python), never imported here
    SITE=$(mktemp -d)
    PLAT=(--python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux2014_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any)
fi
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "${PLAT[@]}" --target "$SITE" \
        .whl/*.whl || { echo "wheel install FAILED"; exit 1; }
    ls "$SITE" | wc -l
fi
export PYTHONPATH=$PWD
if [ "$DRY" != 1 ]; then  # tests start `dlrl`, `deepspeed` next to sys.executable (console scripts pip would install)
    EXE=$($PY -c 'import sys; print(sys.executable)')
    BIN=$(dirname "$EXE")
    echo "import sys; sys.path[:0] = [p for p in ['$SITE'] if p not in sys.path]" \
        >"$($PY -c 'import site; print(site.getsitepackages()[0])')/zz_dlrl_gpu_site.pth"
    [ -x "$BIN/dlrl" ] || printf '#!%s\nimport sys\nfrom dlrl.cli import main\nsys.exit(main())\n' "$EXE" >"$BIN/dlrl"
    chmod +x "$BIN/dlrl"
    for f in "$SITE"/bin/*; do [ -e "$BIN/$(basename "$f")" ] || cp "$f" "$BIN/"; done
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
fi
nproc; command -v taskset || echo "no taskset"
$PY - <<'EOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
for m in ("fastapi", "uvicorn", "pydantic", "deepspeed", "openai", "math_verify", "stamina", "pebble", "transformers",
          "triton"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"))
    except Exception as e:  # report and go on: the tests will say what breaks
        print(m, "IMPORT FAILED", repr(e))
EOF

