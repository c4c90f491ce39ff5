"""The database under the usage ledger, the live keys and the shared rate-limit counters.

One URL picks the backend: `sqlite:///path/to/ledger.db` (the embedded default: WAL mode, a
busy timeout, safe for several ingress replicas on one node) or `postgresql://user@host/db`
(several nodes; needs the `psycopg` package). The SQL is written once, in the subset both
speak (`?` placeholders, rewritten to `%s` for PostgreSQL; `INSERT ... ON CONFLICT`;
`RETURNING`). Each thread gets its own connection. Owns the schema; does not own what the
rows mean (`router/ledger.py`, `router/keys.py`, `router/ratelimit.py`). No Ray, no torch.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS usage_ledger (
        request_id TEXT PRIMARY KEY, key_id TEXT NOT NULL, key_name TEXT NOT NULL,
        plan TEXT NOT NULL, endpoint TEXT NOT NULL, api TEXT NOT NULL, tier TEXT NOT NULL,
        reason TEXT NOT NULL, mode TEXT NOT NULL, speculation_dropped INTEGER NOT NULL,
        status TEXT NOT NULL, http_status INTEGER NOT NULL, prompt_tokens BIGINT NOT NULL,
        completion_tokens BIGINT NOT NULL, speculative_tokens BIGINT NOT NULL,
        draft_tokens BIGINT NOT NULL, accepted_tokens BIGINT NOT NULL,
        price_micro_usd BIGINT NOT NULL, reserved_tokens BIGINT, started_at DOUBLE PRECISION NOT NULL,
        finished_at DOUBLE PRECISION NOT NULL, day TEXT NOT NULL, error TEXT)""",
    "CREATE INDEX IF NOT EXISTS usage_ledger_day ON usage_ledger (day, key_id)",
    """CREATE TABLE IF NOT EXISTS api_keys (
        key_id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, plan TEXT NOT NULL,
        role TEXT NOT NULL, sha256 TEXT NOT NULL UNIQUE, prefix TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL, rotated_at DOUBLE PRECISION,
        revoked_at DOUBLE PRECISION)""",
    """CREATE TABLE IF NOT EXISTS rate_windows (
        key_id TEXT NOT NULL, win TEXT NOT NULL, requests BIGINT NOT NULL, tokens BIGINT NOT NULL,
        expires_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (key_id, win))""",
]


class Database:
    """A thread-safe handle: `with db.transaction() as tx: tx.execute(sql, params)`."""

    def __init__(self, url: str, durable: bool = True, busy_timeout_s: float = 30.0):
        self.url = url
        parsed = urlparse(url)
        if parsed.scheme == "sqlite":
            self.kind = "sqlite"
            # sqlite:///relative/x.db -> "relative/x.db"; sqlite:////abs/x.db -> "/abs/x.db"
            self.path = Path(url[len("sqlite:///"):]).expanduser()
            self.path.parent.mkdir(parents=True, exist_ok=True)
        elif parsed.scheme in ("postgresql", "postgres"):
            self.kind = "postgres"
            try:
                import psycopg  # noqa: F401  (a clear error now rather than at first use)
            except ImportError as exc:
                raise ImportError("the ledger URL is PostgreSQL: install the driver with "
                                  "pip install 'specserve[postgres]' (psycopg)") from exc
        else:
            raise ValueError(f"unknown database URL {url!r}: use sqlite:///PATH or postgresql://...")
        self.durable = durable
        self.busy_timeout_s = busy_timeout_s
        self._local = threading.local()
        self._init_lock = threading.Lock()
        self._schema_ready = False

    def __repr__(self) -> str:
        return f"Database({self.kind}, {self.path if self.kind == 'sqlite' else urlparse(self.url).hostname})"

    # -- connections --------------------------------------------------------------------------
    def _connect(self):
        if self.kind == "sqlite":
            conn = sqlite3.connect(str(self.path), timeout=self.busy_timeout_s,
                                   isolation_level=None, check_same_thread=False)
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
            self._wal(conn)
            # FULL: a commit is on disk when it returns (the ledger deletes its spool after).
            conn.execute(f"PRAGMA synchronous = {'FULL' if self.durable else 'NORMAL'}")
            return conn
        import psycopg

        return psycopg.connect(self.url, autocommit=True, connect_timeout=10)

    def _wal(self, conn) -> None:
        """Put the file in WAL mode (it stays so). Switching needs the file to itself, and
        SQLite answers "database is locked" at once rather than wait out the busy timeout while
        another connection (a thread here, a process beside) switches or writes: switch only
        when not yet in WAL, one thread at a time, and wait for the other connections."""
        if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal":
            return
        deadline = time.monotonic() + self.busy_timeout_s
        with self._init_lock:
            while True:
                try:
                    conn.execute("PRAGMA journal_mode = WAL")
                    return
                except sqlite3.OperationalError as exc:
                    if "locked" not in str(exc) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)

    def _conn(self):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._connect()
        if not self._schema_ready:
            with self._init_lock:
                if not self._schema_ready:
                    self._create_schema(conn)
                    self._schema_ready = True
        return conn

    def _create_schema(self, conn) -> None:
        for attempt in range(3):        # replicas racing on CREATE in PostgreSQL: retry
            try:
                with self._tx(conn) as tx:
                    for statement in SCHEMA:
                        tx.execute(statement)
                return
            except Exception:
                if attempt == 2:
                    raise

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()
            self._local.conn = None

    # -- transactions -------------------------------------------------------------------------
    @contextlib.contextmanager
    def _tx(self, conn):
        if self.kind == "sqlite":
            conn.execute("BEGIN IMMEDIATE")     # take the write lock now: no upgrade deadlock
            try:
                yield _Tx(conn.cursor(), "?")
                conn.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(Exception):
                    conn.execute("ROLLBACK")
                raise
        else:
            with conn.transaction(), conn.cursor() as cur:
                yield _Tx(cur, "%s")

    @contextlib.contextmanager
    def transaction(self):
        """One atomic unit of work; a broken connection is dropped so the next call reconnects."""
        try:
            conn = self._conn()
            with self._tx(conn) as tx:
                yield tx
        except Exception as exc:
            if self.kind == "postgres" and _is_connection_error(exc):
                self.close()
            raise

    def query(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self.transaction() as tx:
            return tx.execute(sql, params).fetchall()


class _Tx:
    """A cursor that takes `?` placeholders whatever the backend."""

    def __init__(self, cursor, placeholder: str):
        self.cursor, self.placeholder = cursor, placeholder

    def execute(self, sql: str, params: tuple = ()):
        if self.placeholder != "?":
            sql = sql.replace("?", self.placeholder)
        self.cursor.execute(sql, params)
        return self

    def executemany(self, sql: str, rows: list[tuple]):
        if self.placeholder != "?":
            sql = sql.replace("?", self.placeholder)
        self.cursor.executemany(sql, rows)
        return self

    def fetchall(self) -> list[tuple]:
        return [tuple(r) for r in self.cursor.fetchall()]

    def fetchone(self):
        row = self.cursor.fetchone()
        return tuple(row) if row is not None else None

    @property
    def rowcount(self) -> int:
        return self.cursor.rowcount


def _is_connection_error(exc: Exception) -> bool:
    try:
        import psycopg
    except ImportError:
        return False
    return isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError))


def default_url() -> str:
    return "sqlite:///" + str(Path("~/.specserve/ledger.db").expanduser())
