"""A real PostgreSQL server for the tests, started in a temporary folder and stopped after.

Uses the distribution's server binaries (`apt-get install postgresql`; .ci/run installs them).
PostgreSQL refuses to run as root: as root the folder belongs to `nobody` and the server runs
as that user (`runuser`). `start()` returns None with the reason when no server can be started.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
import uuid

from models.rendezvous import free_port


def _bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


class PgServer:
    def __init__(self):
        self.folder = self.url_base = None
        self.pg_ctl = _bin("pg_ctl")

    def start(self) -> str | None:
        """Start the server; returns None on success, else why it could not start."""
        initdb = _bin("initdb")
        if not (initdb and self.pg_ctl):
            return "PostgreSQL server binaries (initdb, pg_ctl) not found: apt-get install postgresql"
        try:
            import psycopg  # noqa: F401
        except ImportError:
            return "psycopg is not installed (pip install 'psycopg[binary]')"
        self.folder = tempfile.mkdtemp(prefix="specserve-pg-")
        os.chmod(self.folder, 0o755)
        data = os.path.join(self.folder, "data")
        prefix = []
        if os.geteuid() == 0:
            if not shutil.which("runuser"):
                return "running as root and runuser is missing (PostgreSQL refuses root)"
            os.chown(self.folder, 65534, 65534)
            prefix = ["runuser", "-u", "nobody", "--"]
        port = free_port()
        try:
            subprocess.run(prefix + [initdb, "-D", data, "-A", "trust", "-U", "postgres",
                                     "--no-sync", "-E", "UTF8"],
                           check=True, capture_output=True, text=True, timeout=120)
            subprocess.run(prefix + [self.pg_ctl, "-D", data, "-l", os.path.join(self.folder, "log"),
                                     "-o", f"-p {port} -k {self.folder} -c listen_addresses=127.0.0.1 "
                                     "-c fsync=off", "-w", "-t", "60", "start"],
                           check=True, capture_output=True, text=True, timeout=90)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            log = ""
            with contextlib.suppress(OSError):
                log = open(os.path.join(self.folder, "log")).read()[-2000:]
            out = getattr(exc, "stderr", "") or ""
            self.stop()
            return f"PostgreSQL did not start: {exc}: {out[-1000:]} {log}"
        self._prefix, self._data = prefix, data
        self.url_base = f"postgresql://postgres@127.0.0.1:{port}"
        return None

    def new_database(self) -> str:
        """A fresh, empty database on the server; returns its URL."""
        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url_base + "/postgres", autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return f"{self.url_base}/{name}"

    def stop(self) -> None:
        if self.url_base:
            subprocess.run(self._prefix + [self.pg_ctl, "-D", self._data, "-m", "immediate",
                                           "-w", "stop"], capture_output=True, timeout=60)
            self.url_base = None
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
