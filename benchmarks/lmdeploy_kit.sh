#!/usr/bin/env bash
# Build the LMDeploy kit for a device machine without network (Python 3.12, torch 2.11 + CUDA, transformers and
# triton already there): run here, in the repo root (PyPI reachable); the folder is git-ignored, committed nowhere,
# and travels with `carry: [".whl", ".lmdkit"]` next to benchmarks/device_kit.sh's dlrl wheels (~16 MiB).
#   .lmdkit/lmdeploy-$LMDEPLOY-*.whl   LMDeploy's wheel WITHOUT the turbomind binary (_turbomind*.so and its
#                                      static libs: ~350 MiB of the 106 MiB wheel's 390 MiB; the PyTorch engine,
#                                      which serves SDAR, never loads it), RECORD rewritten to match
#   .lmdkit/*.whl                      the packages its PyTorch engine imports that the device lacks (DEPS below:
#                                      found by importing the engine, lmdeploy.pytorch.models.sdar, the dLLM
#                                      strategy and the update path with only these installed)
#   .lmdkit/setup.sh                   on the device: `source .lmdkit/setup.sh` installs them --no-deps into
#                                      /tmp/lmdsite (LMDeploy's own environment: only the lmdeploy runs put it on
#                                      PYTHONPATH) and checks the imports
#
#   bash benchmarks/lmdeploy_kit.sh             # then, on the device (after source .devkit/setup.sh):
#   source .lmdkit/setup.sh && bash benchmarks/lmdeploy_device.sh
# LMDeploy's own pins (0.18.0): torch <= 2.12.1, transformers >= 4.56 (not 5.0-5.5.0, 5.7-5.9), triton <= 3.7.1:
# the device's torch 2.11 fits; `--no-deps` keeps its torch, CUDA and triton (the nvidia-*-cu12 wheels LMDeploy
# lists are not needed with them). Optional engine features (ray, tilelang, flash-linear-attention, rdkit,
# opencv, peft) are left out: the SDAR path does not import them. Ray in particular: dlrl's weight path loads
# into the 'uni' executor's model agent in-process (server/engine/backends/lmdeploy_weights.py), not through
# Ray's workers; ray 2.60.0's cp312 wheel is 75 MiB (42 MiB without its jars and dashboard), over the 64 MiB
# carry on its own. Add a package to DEPS if the device reports one.
set -euo pipefail
cd "$(dirname "$0")/.."
LMDEPLOY=${LMDEPLOY:-0.18.0}
DEPS=(mmengine-lite yapf addict termcolor platformdirs pybase64 pyzmq shortuuid partial-json-parser xgrammar
      apache-tvm-ffi==0.1.11
      rich markdown-it-py mdurl pygments colorama pillow)  # imported too; an image with torch may lack them
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")" .lmdkit
grep -qxF /.lmdkit/ "$exclude" 2>/dev/null || echo /.lmdkit/ >>"$exclude"
PY=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! ls .lmdkit/lmdeploy-"$LMDEPLOY"-*.whl >/dev/null 2>&1; then
    "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$tmp" "lmdeploy==$LMDEPLOY"
    "$PY" - "$tmp"/lmdeploy-"$LMDEPLOY"-*.whl .lmdkit <<'EOF'
"""Copy a wheel without lmdeploy/turbomind's binaries (the .so and its static libraries); RECORD rewritten."""
import os
import sys
import zipfile

src, out_dir = sys.argv[1], sys.argv[2]
def dropped(name: str) -> bool:
    return name.startswith("lmdeploy/turbomind/") and (name.endswith((".so", ".a")) or "/lib64/" in name)
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(os.path.join(out_dir, os.path.basename(src)), "w",
                                                   zipfile.ZIP_DEFLATED) as zout:
    gone = [i.filename for i in zin.infolist() if dropped(i.filename)]
    for info in zin.infolist():
        if info.filename in gone:
            continue
        data = zin.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line for line in data.splitlines(keepends=True)
                            if line.split(b",")[0].decode() not in gone)
        zout.writestr(info, data)
print(f"lmdeploy_kit: {os.path.basename(src)} without {len(gone)} turbomind binaries")
EOF
fi
for dep in "${DEPS[@]}"; do
    "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d .lmdkit "$dep"
done
cp benchmarks/lmdeploy_kit_setup.sh .lmdkit/setup.sh
du -sh .lmdkit
ls -la .lmdkit
