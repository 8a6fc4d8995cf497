"""A private PostgreSQL server for the test run: initdb in a temporary directory, listening
on a unix socket only (no TCP port at all), run as a non-root user, torn down at the end.
One per test run (a session fixture in tests/conftest.py); each test gets its own schema."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path


def bin_dir() -> Path | None:
    """Where initdb and pg_ctl live (Debian puts them outside PATH)."""
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(versions[-1]).parent if versions else None


def problem() -> str | None:
    """Why no test server can run here, or None."""
    if bin_dir() is None:
        return "PostgreSQL is not installed (apt-get install postgresql-15)"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install 'kernelhub[postgres]')"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no postgres user to run the server as"
    return None


class PostgresCluster:
    def __init__(self) -> None:
        bins = bin_dir()
        assert bins is not None
        self.bins = bins
        self.root = Path(tempfile.mkdtemp(prefix="kh-pg-"))
        self.data = self.root / "data"
        self.socket_dir = self.root  # short: unix socket paths are limited to 108 bytes
        self.log = self.root / "server.log"
        self._as: list[str] = []
        if os.geteuid() == 0:  # the server refuses to run as root
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]

    def _run(self, *args: str) -> None:
        subprocess.run([*self._as, *args], check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        self._run(str(self.bins / "initdb"), "-D", str(self.data), "-U", "kernelhub",
                  "--auth=trust", "-E", "UTF8", "--no-sync")  # fmt: skip
        # Durability is not what these tests measure: fsync off keeps them quick.
        opts = f"-k {self.socket_dir} -c listen_addresses='' -c fsync=off -c full_page_writes=off"
        self._run(str(self.bins / "pg_ctl"), "-D", str(self.data), "-l", str(self.log),
                  "-o", opts, "-w", "-t", "60", "start")  # fmt: skip
        self.url = f"postgresql://kernelhub@/postgres?host={self.socket_dir}"

    def fresh_url(self) -> str:
        """A URL whose connections see only a new, empty schema: one test's database."""
        import psycopg

        schema = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
        return f"{self.url}&options=-csearch_path%3D{schema}"

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._run(str(self.bins / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop")
        shutil.rmtree(self.root, ignore_errors=True)
