"""A real PostgreSQL server for the tests, started in a temporary folder (initdb + pg_ctl).

    pg = PostgresServer.start()               # installs Debian's `postgresql` first when missing (root)
    url = pg.new_database("t1")                # postgresql://dlrl@127.0.0.1:PORT/t1
    pg.stop(); pg.restart(); pg.destroy()

PostgreSQL refuses to run as root: as root the server runs as the `postgres` system user
(the package creates it), otherwise as the current user. Loopback only, `trust` auth
(the tests' own throwaway cluster). The `postgres` fixture of conftest.py starts one per test
session, on first use.

Durability: `synchronous_commit=on`, so a COMMIT returns only once its WAL is written: a
record whose id the server returned survives the PostgreSQL server being killed (`stop("immediate")`,
kill -9), which the durability tests do. With `synchronous_commit=off` a commit returns
before its WAL is written and an acknowledged record can be lost that way (issue 37).
`fsync=off` and `full_page_writes=off` stay: they only matter when the operating system
itself crashes, which no test does (production keeps both on: README, "Recording").
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.helpers import free_port


def _bin_dir() -> Path | None:
    found = shutil.which("pg_ctl")
    if found:
        return Path(os.path.realpath(found)).parent
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda d: int(d.split("/")[-2]))
    return Path(dirs[-1]) if dirs else None


def ensure_postgres() -> Path:
    """The folder of initdb/pg_ctl, installing Debian's `postgresql` with apt-get when missing."""
    found = _bin_dir()
    if found is None:
        if os.geteuid() != 0:
            raise RuntimeError("PostgreSQL (initdb, pg_ctl) is not installed and this is not root: "
                               "apt-get install postgresql")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-q"], check=True, env=env, capture_output=True, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "postgresql"], check=True,
                       env=env, capture_output=True, timeout=900)
        found = _bin_dir()
        if found is None:
            raise RuntimeError("apt-get installed postgresql but no pg_ctl was found")
    return found


class PostgresServer:
    def __init__(self, bin_dir: Path, base: Path, port: int, user: str | None):
        self.bin, self.base, self.port, self.user = bin_dir, base, port, user
        self.data = base / "data"

    @classmethod
    def start(cls) -> PostgresServer:
        bin_dir = ensure_postgres()
        user = "postgres" if os.geteuid() == 0 else None
        base = Path(tempfile.mkdtemp(prefix="dlrl-pg-"))
        if user:
            pw = pwd.getpwnam(user)
            os.chown(base, pw.pw_uid, pw.pw_gid)
        srv = cls(bin_dir, base, free_port(), user)
        srv._run("initdb", "-D", str(srv.data), "-U", "dlrl", "-A", "trust", "-E", "UTF8", "--no-sync")
        srv.restart()
        return srv

    def _run(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.bin / tool), *args], user=self.user, cwd=self.base, check=check,
                              capture_output=True, text=True, timeout=120)

    def restart(self) -> None:
        """Start (again, on the same port and data) and wait until it takes connections."""
        opts = (f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 -c fsync=off "
                "-c synchronous_commit=on -c full_page_writes=off -c max_connections=300")
        done = self._run("pg_ctl", "-D", str(self.data), "-l", str(self.base / "server.log"), "-o", opts,
                         "-w", "-t", "60", "start", check=False)
        if done.returncode != 0:
            log = (self.base / "server.log").read_text() if (self.base / "server.log").exists() else ""
            raise RuntimeError(f"pg_ctl start failed: {done.stdout}{done.stderr}{log[-2000:]}")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop", check=False)

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://dlrl@127.0.0.1:{self.port}/{dbname}"

    def new_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def destroy(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.base, ignore_errors=True)
